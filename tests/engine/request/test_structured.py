"""Structured outputs (engine/request/structured.py): the bitmask op against a loop oracle, grammar masks
against the tokenizer's own bytes, and constrained generation on a tiny random K3."""

import json

import pytest
import torch

from deltaserve import LLM, SamplingParams
from deltaserve.engine.request.sampling_params import SamplingParamsError
from deltaserve.engine.request.sequence import InvalidRequestError
from deltaserve.engine.request.structured import (
    GrammarCompiler,
    Special,
    StructuredOutput,
    StructuredOutputError,
    apply_bitmask,
    tool_call_schema,
)
from deltaserve.model.tokenizer import Tokenizer
from deltaserve.tiny import make_tiny

BOUNDED = {
    "type": "object",
    "additionalProperties": False,
    "required": ["city", "days", "metric"],
    "properties": {
        "city": {"enum": ["Paris", "Oslo"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
        "metric": {"type": "boolean"},
    },
}
THINK_END = (Special("<|close|>"), "think", Special("<|sep|>"), Special("<|open|>"), "response", Special("<|sep|>"))


def check_bounded(v) -> None:
    """Independent check of BOUNDED."""
    assert isinstance(v, dict) and set(v) == {"city", "days", "metric"}, v
    assert v["city"] in ("Paris", "Oslo") and type(v["days"]) is int and 1 <= v["days"] <= 7
    assert type(v["metric"]) is bool


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny(tmp_path_factory.mktemp("k3"), family="kimi_k3", preset="tiny", seed=0)


@pytest.fixture(scope="module")
def tok(ckpt):
    return Tokenizer.from_pretrained(ckpt)


@pytest.fixture(scope="module")
def compiler(tok):
    return GrammarCompiler(tok, tok.vocab_size + 40, sorted(tok.stop_token_ids))


def allowed(state, vocab) -> set[int]:
    x = torch.zeros(1, vocab)
    apply_bitmask(x, [0], [state.bitmask()])
    return set(torch.isfinite(x[0]).nonzero().flatten().tolist())


def test_apply_bitmask_matches_loop_oracle():
    g = torch.Generator().manual_seed(0)
    vocab, rows = 77, [0, 2, 3]
    x = torch.randn(5, vocab, generator=g)
    x[3] = float("-inf")  # row 3: everything banned -> refilled from the fallback
    masks = [torch.randint(-(2**31), 2**31 - 1, (3,), generator=g, dtype=torch.int64).to(torch.int32) for _ in rows]
    fallback = torch.randn(len(rows), vocab, generator=g)
    out = x.clone()
    apply_bitmask(out, rows, masks, fallback)
    want = x.clone()
    for j, r in enumerate(rows):
        src = fallback[j] if r == 3 else x[r]
        for t in range(vocab):
            bit = (int(masks[j][t // 32]) >> (t % 32)) & 1
            want[r, t] = src[t] if bit else float("-inf")
    assert torch.equal(out, want)


def test_json_mask_matches_token_bytes(tok, compiler):
    vocab = compiler.vocab_size
    state = compiler.compile(StructuredOutput.json())
    first = allowed(state, vocab)
    want = {i for i in range(tok.vocab_size) if not tok.is_special(i) and tok.token_bytes(i) == b"{"}
    assert want <= first and first <= {i for i in range(tok.vocab_size) if not tok.is_special(i)}
    assert all(tok.token_bytes(i).startswith(b"{") and b" " not in tok.token_bytes(i) for i in first)
    ids = tok.encode('{"a":[1,true,null],"b":"x"}')
    for t in ids:
        assert t in allowed(state, vocab)
        assert state.advance(t) == (t == ids[-1])  # done exactly when the object closes
    assert allowed(state, vocab) == set(tok.stop_token_ids)  # complete: only EOS, no padding ids


def test_bounded_random_walks_are_valid(tok, compiler):
    """Uniform walks over the allowed set: every walk ends with JSON valid for the schema."""
    g = torch.Generator().manual_seed(1)
    base = compiler.compile(StructuredOutput.json(BOUNDED))
    specials = {i for i in range(tok.vocab_size) if tok.is_special(i)}
    for _ in range(8):
        state, ids, done = base.copy(), [], False
        while not done:
            ok = sorted(allowed(state, compiler.vocab_size))
            t = ok[int(torch.randint(len(ok), (1,), generator=g))]
            assert t not in specials
            ids.append(t)
            done = state.advance(t)
        v = json.loads(tok.decode(ids))
        check_bounded(v)
        assert list(v) == ["city", "days", "metric"]  # the schema's declared key order
        assert state.accepting and state.error is None


def test_reasoning_prefix(tok, compiler):
    vocab = compiler.vocab_size
    state = compiler.compile(StructuredOutput.json(None, THINK_END))
    close = tok.special_tokens["<|close|>"]
    plain = {i for i in range(tok.vocab_size) if not tok.is_special(i)}

    def utf8(i):
        try:
            return bool(tok.token_bytes(i).decode("utf-8"))
        except UnicodeDecodeError:
            return False

    first = allowed(state, vocab)
    assert close in first and first - {close} <= plain  # free text: no other control token
    assert {i for i in plain if utf8(i)} <= first
    for t in tok.encode("let me think") + tok.encode(
        "<|close|>think<|sep|><|open|>response<|sep|>", allow_special=True
    ):
        assert not state.advance(t)
    assert all(tok.token_bytes(i).startswith(b"{") for i in allowed(state, vocab))
    with pytest.raises(StructuredOutputError, match="control tokens"):
        compiler.compile(StructuredOutput.json(None, (Special("<|nope|>"),)))


@pytest.mark.parametrize(
    "schema",
    [{"type": "nonsense"}, {"$ref": "#/nope"}, {"type": "string", "pattern": "("}, {"type": "integer", "minimum": "a"}],
)
def test_invalid_schema(compiler, schema):
    with pytest.raises(StructuredOutputError, match="invalid JSON schema"):
        compiler.compile(StructuredOutput.json(schema))


def test_structured_output_value():
    assert StructuredOutput.json({"type": "object"}) == StructuredOutput.json()
    ordered = StructuredOutput.json({"type": "object", "properties": {"z": {}, "a": {}}})
    assert ordered.lark().index('"z"') < ordered.lark().index('"a"')  # declared order, not sorted
    with pytest.raises(StructuredOutputError):
        StructuredOutput.json("not a dict")
    with pytest.raises(StructuredOutputError):
        StructuredOutput.json({"x": float("nan")})
    with pytest.raises(SamplingParamsError, match="structured"):
        SamplingParams(structured={"type": "object"})


def test_tool_call_schema():
    tools = [
        {"type": "function", "function": {"name": "a", "parameters": BOUNDED}},
        {"type": "function", "function": {"name": "b"}},
    ]
    assert tool_call_schema(tools, "a") == BOUNDED
    assert tool_call_schema(tools, "b") == {"type": "object"}
    req = tool_call_schema(tools)
    assert req["type"] == "array" and req["minItems"] == 1
    assert [v["properties"]["name"] for v in req["items"]["anyOf"]] == [{"const": "a"}, {"const": "b"}]
    with pytest.raises(StructuredOutputError, match="not among"):
        tool_call_schema(tools, "c")


@pytest.fixture(scope="module")
def llm(ckpt):
    return LLM(
        ckpt,
        dtype="float32",
        max_num_seqs=4,
        max_num_batched_tokens=256,
        page_size=16,
        kv_cache_memory=32 * 2**20,
        max_model_len=256,
        progress=False,
    )


def test_generate_bounded_json(llm):
    so = StructuredOutput.json(BOUNDED)
    prompts = ["Weather as JSON:", [5, 6, 7]]
    outs = llm.generate(
        prompts,
        [
            SamplingParams(n=3, max_tokens=60, temperature=1.0, seed=3, structured=so),
            SamplingParams(max_tokens=60, temperature=0, structured=so, min_tokens=50),
        ],
        use_tqdm=False,
    )
    texts = [c for o in outs for c in o.outputs]
    assert len(texts) == 4
    for c in texts:
        assert c.finish_reason == "stop"  # the grammar completed (min_tokens cannot outlast it)
        check_bounded(json.loads(c.text))
    assert not llm.engine.grammars
    llm.check_integrity()


def test_invalid_schema_leaves_no_trace(llm):
    before = llm.stats()["requests_added"]
    with pytest.raises(InvalidRequestError, match="invalid JSON schema"):
        llm.generate(["x"], SamplingParams(structured=StructuredOutput.json({"type": "nonsense"})), use_tqdm=False)
    assert llm.stats()["requests_added"] == before and not llm.engine.grammars
    rid = "abort-me"
    llm.engine.add_request(rid, [1, 2, 3], SamplingParams(n=2, structured=StructuredOutput.json()))
    assert len(llm.engine.grammars) == 2
    llm.engine.abort_request(rid)
    assert not llm.engine.grammars
    llm.check_integrity()


def test_markerless_text_is_token_level(tok, compiler):
    """`%text%`: non-control tokens never spelling `<|` (not inside a token, not across two), and,
    being token-level, closable after any token, a split UTF-8 character included (a reasoning
    budget forces the close there; a character-level rule refused it)."""
    vocab, close = compiler.vocab_size, tok.special_tokens["<|close|>"]
    grammar = StructuredOutput.raw("start: text <|close|>\ntext: %text%\n")
    plain = {i for i in range(tok.vocab_size) if not tok.is_special(i)}
    spells = {i for i in plain if b"<|" in tok.token_bytes(i)}
    state = compiler.compile(grammar)
    assert allowed(state, vocab) == (plain - spells) | {close}
    lt, bar = tok.encode("<"), tok.encode("|")
    assert len(lt) == 1 and len(bar) == 1
    assert not state.advance(lt[0])
    after = allowed(state, vocab)
    assert close in after and bar[0] not in after
    assert {i for i in plain - spells if not tok.token_bytes(i).startswith(b"|")} <= after
    state = compiler.compile(grammar)
    assert not state.advance(tok.encode("x")[0])
    half = next(i for i in plain if len(tok.token_bytes(i)) == 1 and tok.token_bytes(i)[0] >= 0xC0)
    assert not state.advance(half)  # the first byte of a two-byte character
    assert close in allowed(state, vocab)
