"""IncrementalDetokenizer on a tiny checkpoint's tokenizer, against full re-decoding and a
slow stop-string oracle written here."""

import random

import pytest

from deltaserve.engine.request.detokenizer import IncrementalDetokenizer
from deltaserve.engine.request.sampling_params import SamplingParams as SP
from deltaserve.model.tokenizer import Tokenizer
from deltaserve.tiny import make_tiny


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return Tokenizer.from_pretrained(make_tiny(tmp_path_factory.mktemp("k3"), family="kimi_k3"))


def feed(tok, ids, params, delta_every=1):
    """Append ids one by one, calling delta() every `delta_every` tokens; returns
    (detok, concatenated deltas, number of tokens consumed when it stopped)."""
    d, pieces, used = IncrementalDetokenizer(tok, params), [], len(ids)
    for k, i in enumerate(ids, 1):
        stopped = d.append(i)
        if k % delta_every == 0:
            pieces.append(d.delta())
        if stopped:
            used = k
            break
    pieces.append(d.delta(final=True))
    return d, "".join(pieces), used


def oracle(tok, ids, params):
    """Re-decode every prefix (complete characters only; `ids` must decode to valid UTF-8);
    from the min_tokens-th id on, a stop string must end in the characters that id completed
    (vLLM's StopChecker); the earliest-ending (then earliest-starting) match wins."""
    skip, old = params.skip_special_tokens, ""
    for k in range(1, len(ids) + 1):
        text = tok.decode_bytes(ids[:k], skip).decode("utf-8", errors="ignore")
        if k >= params.min_tokens and len(text) > len(old):
            hits = []
            for s in params.stop:
                i = text.find(s, max(0, len(old) - len(s) + 1))
                if i >= 0:
                    hits.append((i + len(s), i, s))
            if hits:
                end, start, s = min(hits)
                return (text[:end] if params.include_stop_str_in_output else text[:start]), s, k
        old = text
    return tok.decode(ids, skip), None, len(ids)


def test_random_ids_match_full_decode(tok):
    rnd = random.Random(0)
    for trial in range(60):
        ids = [rnd.randrange(tok.vocab_size) for _ in range(rnd.randint(1, 40))]
        if trial % 2:  # bias towards single bytes, which split UTF-8 sequences
            ids = [rnd.randrange(256) if rnd.random() < 0.7 else i for i in ids]
        for skip in (True, False):
            params = SP(skip_special_tokens=skip)
            d = IncrementalDetokenizer(tok, params)
            for k, i in enumerate(ids, 1):
                assert not d.append(i)
                full = tok.decode(ids[:k], skip)
                assert full.startswith(d.text)
                held = tok.decode_bytes(ids[:k], skip)[len(d.text.encode()) :]
                assert len(held) < 4  # only an incomplete UTF-8 tail is ever held back
            d2, joined, _ = feed(tok, ids, params, delta_every=rnd.randint(1, 5))
            assert d2.text == joined == tok.decode(ids, skip)


def test_multibyte_text_token_by_token(tok):
    text = "emoji 🎉🚀👩‍👩‍👧 中文测试：你好世界！ naïve ½ ∑ 😀 end"
    ids = tok.encode(text)
    prefixes = [tok.decode_bytes(ids[:k]) for k in range(len(ids) + 1)]
    splits = 0
    for b in prefixes:
        try:
            b.decode("utf-8")
        except UnicodeDecodeError:
            splits += 1
    assert splits > 5  # the tiny vocabulary really splits characters across tokens
    d = IncrementalDetokenizer(tok, SP())
    for k, i in enumerate(ids, 1):
        d.append(i)
        assert "\ufffd" not in d.text
        assert text.startswith(d.text)
        assert prefixes[k].decode("utf-8", errors="ignore").startswith(d.text)
    assert d.text == text
    assert feed(tok, ids, SP())[1] == text


def test_incomplete_tail_flushed_as_replacement(tok):
    lead = tok.token_to_id(b"\xe4")
    d = IncrementalDetokenizer(tok, SP())
    for i in tok.encode("ab") + [lead]:
        d.append(i)
    assert d.text == "ab"
    assert d.delta() == "ab"
    assert d.delta(final=True) == "\ufffd"
    assert d.text == "ab\ufffd" == tok.decode(tok.encode("ab") + [lead])
    assert d.delta(final=True) == "" and not d.append(tok.encode("x")[0])


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_across_tokens(tok, include):
    text = "Hello world, this is the STOP marker and more text"
    ids = tok.encode(text)
    stop = "the STOP mar"
    assert not any(stop in tok.decode([i]) for i in ids)
    d, joined, used = feed(tok, ids, SP(stop=["zzz", stop], include_stop_str_in_output=include))
    want = "Hello world, this is the STOP mar" if include else "Hello world, this is "
    assert d.text == joined == want and d.stop_reason == stop
    assert used < len(ids) and stop in tok.decode(ids[:used]) and stop not in tok.decode(ids[: used - 1])


def test_delta_holds_back_possible_stop_prefix(tok):
    d = IncrementalDetokenizer(tok, SP(stop=["world"]))
    for i in tok.encode("Hello wor"):
        d.append(i)
    assert d.delta() == "Hello "
    for i in tok.encode("m"):
        d.append(i)
    assert d.delta() == "worm"
    d = IncrementalDetokenizer(tok, SP(stop=["world"]))
    for i in tok.encode("Hello wor"):
        d.append(i)
    assert d.delta() == "Hello "
    assert any(d.append(i) for i in tok.encode("ld!"))
    assert d.delta() == "" and d.text == "Hello " and d.stop_reason == "world"
    d = IncrementalDetokenizer(tok, SP(stop=["world"], include_stop_str_in_output=True))
    for i in tok.encode("Hello wor"):
        d.append(i)
    assert d.delta() == "Hello wor"


def test_random_stops_vs_oracle(tok):
    rnd = random.Random(5)
    alphabet = ["a", "b", " ", "ab", "\n", "你", "🎉", "é"]
    for _ in range(300):
        text = "".join(rnd.choice(alphabet) for _ in range(rnd.randint(1, 25)))
        ids = tok.encode(text)
        stops = ["".join(rnd.choice(alphabet) for _ in range(rnd.randint(1, 3))) for _ in range(rnd.randint(1, 3))]
        params = SP(
            stop=stops, include_stop_str_in_output=rnd.random() < 0.5, min_tokens=rnd.choice([0, 0, 3]), max_tokens=None
        )
        want_text, want_reason, want_used = oracle(tok, ids, params)
        d, joined, used = feed(tok, ids, params, delta_every=rnd.randint(1, 3))
        assert (d.text, d.stop_reason, used) == (want_text, want_reason, want_used), (text, stops)
        assert joined == d.text


def test_special_tokens_skipped_or_kept(tok):
    eos = tok.eos_token_id
    ids = tok.encode("hi") + [eos, 2000] + tok.encode(" there")
    assert feed(tok, ids, SP())[0].text == "hi there"
    kept = feed(tok, ids, SP(skip_special_tokens=False))[0]
    assert kept.text == "hi<|end_of_msg|><|reserved_token_2000|> there" == tok.decode(ids)
    d, joined, used = feed(tok, ids, SP(skip_special_tokens=False, stop=["<|end_of_msg|>"]))
    assert d.text == joined == "hi" and used == len(tok.encode("hi")) + 1
    assert feed(tok, ids, SP(stop=["<|end_of_msg|>"]))[0].stop_reason is None


def test_min_tokens_delays_stop_strings(tok):
    ids = tok.encode("ab ab ab ab")
    assert [tok.decode([i]) for i in ids] == ["ab", " ab", " ab", " ab"]
    d = feed(tok, ids, SP(stop=["ab"], min_tokens=3))[0]
    assert d.text == "ab ab " and d.stop_reason == "ab"
    assert feed(tok, ids, SP(stop=["ab"]))[0].text == ""
    d = feed(tok, tok.encode("xx ab"), SP(stop=["ab"], min_tokens=5))[0]
    assert d.stop_reason is None and d.text == "xx ab"
