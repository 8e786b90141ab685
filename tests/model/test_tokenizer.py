"""Tokenizer on tiny checkpoints' files (spec/model.md §13, §18 item 21): round trips, the
two encoding modes, the model's eos vs the tokenizer's [EOS], reserved names, the reference's
long-input slicing, and clear errors for missing / malformed files."""

import json
import random
import shutil

import pytest

from deltaserve.model import tokenizer as tokmod
from deltaserve.model.tokenizer import Tokenizer, TokenizerError
from deltaserve.tiny import make_tiny

TEXTS = [
    "",
    "Hello, world!",
    "  leading and trailing  ",
    "it's we'll THEY'RE don't\n\n\n",
    "数字 12345678 и кириллица, ελληνικά",
    "你好世界，这是一个测试。Kimi模型",
    "emoji 🎉🚀👩‍👩‍👧 mixed",
    "tabs\tand\r\nwindows\nlines",
    "<|end_of_msg|> <|im_end|> [EOS] [BOS] <|open|>message",
    "naïve café résumé — “quotes” ½ ∑ ∫",
    "\u00a0\u2003nbsp and em space\u3000",
]


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("tok")
    return {fam: make_tiny(root / fam, family=fam) for fam in ("kimi_k3", "kimi_linear")}


@pytest.fixture(scope="module")
def toks(dirs):
    return {fam: Tokenizer.from_pretrained(d) for fam, d in dirs.items()}


def named(d):
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    return {v["content"]: int(k) for k, v in cfg["added_tokens_decoder"].items()}


@pytest.mark.parametrize("fam", ["kimi_k3", "kimi_linear"])
def test_round_trip(toks, fam):
    tok = toks[fam]
    rnd = random.Random(0)
    alphabet = "ab Z9\n\t你好🎉é,.'<|>"
    texts = TEXTS + ["".join(rnd.choice(alphabet) for _ in range(rnd.randint(1, 60))) for _ in range(50)]
    for t in texts:
        ids = tok.encode(t)
        assert all(0 <= i < tok.n_base for i in ids)
        assert tok.decode(ids) == t
        assert tok.decode_bytes(ids) == t.encode("utf-8")


def test_sizes_and_specials(toks, dirs):
    tok = toks["kimi_k3"]
    assert (tok.vocab_size, tok.n_base, len(tok)) == (2048, 1792, 2048)
    assert tok.special_ids == frozenset(range(1792, 2048))
    for name, i in named(dirs["kimi_k3"]).items():
        assert tok.id_to_token(i) == name and tok.token_to_id(name) == i
    assert tok.id_to_token(1792 + 6) == "<|reserved_token_1798|>"
    assert tok.token_to_id("<|reserved_token_2000|>") == 2000
    assert tok.id_to_token(64) == "a"  # cl100k rank 64 is b"a"
    assert tok.token_to_id("a") == 64 and tok.token_to_id(b"a") == 64
    assert tok.token_to_id("no such token at all") is None


@pytest.mark.parametrize("fam,eos_name", [("kimi_k3", "<|end_of_msg|>"), ("kimi_linear", "<|im_end|>")])
def test_model_eos_not_tokenizer_eos(toks, dirs, fam, eos_name):
    tok, ids = toks[fam], named(dirs[fam])
    assert tok.eos_token_id == ids[eos_name] != ids["[EOS]"]
    assert tok.stop_token_ids == {ids[eos_name]}
    assert tok.bos_token_id == ids["[BOS]"] and tok.pad_token_id == ids["[PAD]"]


def test_generation_config_takes_precedence(dirs, tmp_path):
    d = tmp_path / "k3"
    shutil.copytree(dirs["kimi_k3"], d)
    gen = json.loads((d / "generation_config.json").read_text())
    gen["eos_token_id"] = [1794, 1793]
    (d / "generation_config.json").write_text(json.dumps(gen))
    tok = Tokenizer.from_pretrained(d)
    assert tok.eos_token_id == 1794 and tok.stop_token_ids == {1793, 1794}
    (d / "generation_config.json").unlink()
    assert Tokenizer.from_pretrained(d).stop_token_ids == {1794}  # from config.json


@pytest.mark.parametrize("fam", ["kimi_k3", "kimi_linear"])
def test_special_strings_are_plain_text_by_default(toks, dirs, fam):
    tok = toks[fam]
    for name, i in named(dirs[fam]).items():
        text = f"say {name} now"
        plain = tok.encode(text)
        assert i not in plain and not set(plain) & tok.special_ids
        assert tok.decode(plain) == text
        assert i in tok.encode(text, allow_special=True)
        assert tok.encode(name, allow_special=True) == [i]
    assert tok.encode("<|reserved_token_1800|>", allow_special=True) == [1800]


def test_decode_skip_special(toks):
    tok = toks["kimi_k3"]
    ids = tok.encode("<|open|>message<|sep|>hi<|end_of_msg|>", allow_special=True)
    assert tok.decode(ids) == "<|open|>message<|sep|>hi<|end_of_msg|>"
    assert tok.decode(ids, skip_special_tokens=True) == "messagehi"
    assert tok.decode_bytes([1794, 2000], skip_special_tokens=True) == b""


def test_decode_replaces_invalid_utf8_and_rejects_bad_ids(toks):
    tok = toks["kimi_k3"]
    split = tok.encode("🎉")
    assert len(split) > 1
    assert tok.decode(split[:1]) == "\ufffd" and tok.decode(split) == "🎉"
    for bad in (-1, 2048, 10**9):
        with pytest.raises(TokenizerError, match="outside the vocabulary"):
            tok.decode([bad])
    with pytest.raises(TypeError):
        tok.decode([1.5])


def test_han_runs_are_pretokenised_separately(toks):
    tok = toks["kimi_k3"]
    for a, b in [("你好", "abc"), ("abc", "世界"), ("模型", "123")]:
        assert tok.encode(a + b) == tok.encode(a) + tok.encode(b)


def _reference_slices(s, max_len):
    """The reference's `_split_whitespaces_or_nonwhitespaces`, written out."""
    cur_len, cur_space, start = 0, s[0].isspace() if s else False, 0
    for i, ch in enumerate(s):
        if cur_space ^ ch.isspace():
            cur_len, cur_space = 1, ch.isspace()
        else:
            cur_len += 1
            if cur_len > max_len:
                yield s[start:i]
                start, cur_len = i, 1
    yield s[start:]


def test_long_input_slicing_matches_reference(monkeypatch):
    monkeypatch.setattr(tokmod, "MAX_RUN_CHARS", 5)
    monkeypatch.setattr(tokmod, "MAX_ENCODE_CHARS", 23)
    rnd = random.Random(1)
    for _ in range(300):
        s = "".join(rnd.choice("ab \n\u00a0\u2003x") for _ in range(rnd.randint(0, 80)))
        expected = [p for i in range(0, len(s), 23) for p in _reference_slices(s[i : i + 23], 5)]
        assert list(tokmod._split_runs(s)) == expected
        assert "".join(expected) == s


def test_long_input_round_trip(toks):
    tok = toks["kimi_k3"]
    text = "x" * 30_000 + " " * 26_000 + "end"
    ids = tok.encode(text)
    assert tok.decode(ids) == text


def test_missing_and_malformed_files(dirs, tmp_path):
    with pytest.raises(TokenizerError, match="does not exist"):
        Tokenizer.from_pretrained(tmp_path / "nowhere")

    def copy(name):
        d = tmp_path / name
        shutil.copytree(dirs["kimi_k3"], d)
        return d

    d = copy("no_model")
    (d / "tiktoken.model").unlink()
    with pytest.raises(TokenizerError, match="tiktoken.model is missing"):
        Tokenizer.from_pretrained(d)
    d = copy("no_cfg")
    (d / "tokenizer_config.json").unlink()
    with pytest.raises(TokenizerError, match="tokenizer_config.json is missing"):
        Tokenizer.from_pretrained(d)
    d = copy("bad_json")
    (d / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(TokenizerError, match="not valid JSON"):
        Tokenizer.from_pretrained(d)
    d = copy("bad_line")
    with (d / "tiktoken.model").open("a") as f:
        f.write("!!notbase64 1792\n")
    with pytest.raises(TokenizerError, match=r"tiktoken.model:1793: malformed"):
        Tokenizer.from_pretrained(d)
    d = copy("bad_rank")
    lines = (d / "tiktoken.model").read_text().splitlines()
    (d / "tiktoken.model").write_text("\n".join(lines[:10] + lines[11:]) + "\n")
    with pytest.raises(TokenizerError, match="out of order"):
        Tokenizer.from_pretrained(d)
    d = copy("no_eos")
    (d / "generation_config.json").unlink()
    cfg = json.loads((d / "config.json").read_text())
    cfg.pop("eos_token_id")
    cfg["text_config"].pop("eos_token_id")
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(TokenizerError, match="no eos_token_id"):
        Tokenizer.from_pretrained(d)
    d = copy("bad_special")
    tcfg = json.loads((d / "tokenizer_config.json").read_text())
    tcfg["added_tokens_decoder"]["5"] = {"content": "<|bogus|>"}
    (d / "tokenizer_config.json").write_text(json.dumps(tcfg))
    with pytest.raises(TokenizerError, match="outside the reserved range"):
        Tokenizer.from_pretrained(d)
