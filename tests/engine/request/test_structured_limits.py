"""Structured outputs decided at request time (schemas with no finite value, size and llguidance
limits), grammar failures while decoding ("error", never "stop"), and reasoning budgets
(engine/request/schema_check.py, engine/request/structured.py, engine/request/reasoning.py) on a tiny random K3."""

import json
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from deltaserve import SamplingParams
from deltaserve.chat.render import render_chat
from deltaserve.engine.request.reasoning import ReasoningBudget
from deltaserve.engine.request.sampling_params import SamplingParamsError
from deltaserve.engine.request.schema_check import no_finite_instance, pattern_size
from deltaserve.engine.request.sequence import InvalidRequestError
from deltaserve.engine.request.structured import (
    MAX_SCHEMA_BYTES,
    GrammarCompiler,
    Special,
    StructuredOutput,
    StructuredOutputError,
)
from tests.engine.request.test_structured import (  # noqa: F401 (fixtures)
    BOUNDED,
    THINK_END,
    check_bounded,
    ckpt,
    compiler,
    llm,
    tok,
)

SELF = {"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}
LOOP = {"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}}
LIST = {
    "$defs": {
        "node": {
            "type": "object",
            "required": ["v"],
            "properties": {"v": {"type": "integer"}, "next": {"$ref": "#/$defs/node"}},
        }
    },
    "$ref": "#/$defs/node",
}


@pytest.mark.parametrize(
    "schema,none",
    [
        (SELF, True),
        (LOOP, True),
        ({"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/a"}}}, True),
        (
            {
                "type": "object",
                "properties": {"a": {"type": "array", "items": {"$ref": "#"}, "minItems": 1}},
                "required": ["a"],
            },
            True,
        ),
        ({"type": "array", "prefixItems": [{"type": "integer"}, {"$ref": "#"}], "minItems": 2}, True),
        ({"allOf": [{"type": "integer"}, SELF]}, True),
        ({"anyOf": [SELF, {"$ref": "#/anyOf/0"}]}, True),
        ({"type": "object", "required": ["x"], "additionalProperties": False}, True),
        ({"type": "object", "properties": {"a": {"$ref": "#"}}}, False),  # "a" optional: {} is finite
        (
            {"type": "object", "properties": {"a": {"type": "array", "items": {"$ref": "#"}}}, "required": ["a"]},
            False,
        ),  # {"a": []}
        ({"type": ["object", "null"], "properties": {"a": {"$ref": "#"}}, "required": ["a"]}, False),
        ({"anyOf": [SELF, {"type": "null"}]}, False),
        ({"properties": {"a": {"$ref": "#"}}, "required": ["a"]}, False),  # untyped: 1 is an instance
        (LIST, False),
        (
            {
                "type": "object",
                "properties": {"a": {"enum": [1]}, "b": {"$ref": "#/properties/a"}},
                "required": ["a", "b"],
            },
            False,
        ),
    ],
)
def test_no_finite_instance(schema, none):
    assert no_finite_instance(schema) is none


@pytest.mark.parametrize(
    "schema,match",
    [
        (SELF, "no finite JSON value"),
        (LOOP, "no finite JSON value"),
        (
            {
                "type": "object",
                "properties": {"a": {"type": "array", "items": {"$ref": "#"}, "minItems": 1}},
                "required": ["a"],
            },
            "no finite JSON value",
        ),
        ({"type": "string", "pattern": "a" * MAX_SCHEMA_BYTES}, "too large"),
    ],
)
def test_refused_at_compile(compiler, schema, match):
    with pytest.raises(StructuredOutputError, match=match):
        compiler.compile(StructuredOutput.json(schema))
    with pytest.raises(StructuredOutputError, match=match):
        compiler.compile(StructuredOutput.json(schema, THINK_END))


def test_llguidance_limits(tok):
    """A pattern within the size cap but over the lexer budget is refused with llguidance's reason."""
    small = GrammarCompiler(tok, tok.vocab_size, sorted(tok.stop_token_ids), limits={"initial_lexer_fuel": 100_000})
    pattern = "^(" + "|".join(f"w{i}x" for i in range(15000)) + ")$"
    with pytest.raises(StructuredOutputError, match="invalid JSON schema: .*too big"):
        small.compile(StructuredOutput.json({"type": "string", "pattern": pattern}))
    small.compile(StructuredOutput.json(BOUNDED))


def test_compile_cache_is_thread_safe(compiler, tok):
    schemas = [
        StructuredOutput.json(
            {
                "type": "object",
                "properties": {f"k{i}": {"type": "integer"}},
                "required": [f"k{i}"],
                "additionalProperties": False,
            }
        )
        for i in range(6)
    ]
    with ThreadPoolExecutor(4) as pool:
        states = list(pool.map(compiler.compile, schemas * 4))
    for j, state in enumerate(states):
        for t in tok.encode('{"k%d":7}' % (j % 6)):
            assert state.failure is None
            state.advance(t)
        assert state.accepting and state.failure is None
    a, b = compiler.compile(schemas[0]), compiler.compile(schemas[0])
    a.advance(tok.encode("{")[0])
    assert b.bitmask().tolist() == compiler.compile(schemas[0]).bitmask().tolist()  # independent


def test_reasoning_budget_state():
    b = ReasoningBudget(2, (90, 91), frozenset({90, 91, 99}))
    seen = []
    for t in (5, 6, 90, 91, 7):
        seen.append(b.forced())
        b.advance(t)
    assert seen == [None, None, 90, 91, None] and b.done and b.used == 2
    natural = ReasoningBudget(5, (90, 91), frozenset({90, 91, 99}))
    for t in (5, 99, 6, 7, 8, 9, 10):
        assert natural.forced() is None
        natural.advance(t)
    assert natural.done and natural.used == 1
    assert ReasoningBudget(0, (90,), frozenset()).forced() == 90


def test_sampling_params_reasoning_fields():
    so = StructuredOutput.json(None, THINK_END)
    assert SamplingParams(structured=so, thinking_token_budget=3).reasoning_close == THINK_END
    assert SamplingParams(reasoning_end=list(THINK_END), thinking_token_budget=0).reasoning_end == THINK_END
    assert SamplingParams(reasoning_end=THINK_END).reasoning_close == THINK_END
    for kw, match in [
        (dict(thinking_token_budget=4), "needs reasoning_end"),
        (dict(reasoning_end=THINK_END, thinking_token_budget=-1), "thinking_token_budget"),
        (dict(reasoning_end=THINK_END, thinking_token_budget=True), "thinking_token_budget"),
        (dict(reasoning_end=("think", Special("<|close|>"))), "starting with a Special"),
        (dict(reasoning_end=THINK_END[:2], structured=so), "prefix"),
    ]:
        with pytest.raises(SamplingParamsError, match=match):
            SamplingParams(**kw)


@pytest.fixture(scope="module")
def think_prompt(llm):
    return render_chat(llm.tokenizer, "kimi_k3", [{"role": "user", "content": "Weather?"}], thinking=True)


def split_reasoning(tok, ids):
    """(reasoning ids, the rest): reasoning ends at the first control token."""
    k = next(i for i, t in enumerate(ids) if tok.is_special(t))
    return ids[:k], ids[k:]


@pytest.mark.parametrize("budget", [0, 1, 5, 12])
def test_budget_closes_thinking_then_json(llm, think_prompt, budget):
    """Random weights never close the think element: the engine does, after `budget` tokens."""
    tok = llm.tokenizer
    end = tok.encode("<|close|>think<|sep|><|open|>response<|sep|>", allow_special=True)
    sp = SamplingParams(
        n=3,
        max_tokens=80,
        seed=budget,
        temperature=1.0,
        thinking_token_budget=budget,
        structured=StructuredOutput.json(BOUNDED, THINK_END),
    )
    [out] = llm.generate([think_prompt], sp, use_tqdm=False)
    for c in out.outputs:
        reasoning, rest = split_reasoning(tok, c.token_ids)
        assert len(reasoning) <= budget and rest[: len(end)] == end, c.text
        check_bounded(json.loads(tok.decode(rest[len(end) :])))
        assert c.finish_reason == "stop"
    assert not llm.engine.grammars and not llm.engine.budgets
    llm.check_integrity()


def test_default_budget_applies_to_structured_only(llm, think_prompt, monkeypatch):
    tok = llm.tokenizer
    monkeypatch.setattr(llm.engine, "structured_thinking_budget", 4)
    so = StructuredOutput.json(BOUNDED, THINK_END)
    [c] = llm.generate([think_prompt], SamplingParams(max_tokens=80, seed=3, structured=so), use_tqdm=False)[0].outputs
    reasoning, rest = split_reasoning(tok, c.token_ids)
    assert len(reasoning) <= 4 and c.finish_reason == "stop"
    check_bounded(json.loads(c.text[c.text.index("{") :]))
    [free] = llm.generate(
        [think_prompt], SamplingParams(max_tokens=20, seed=3, ignore_eos=True, reasoning_end=THINK_END), use_tqdm=False
    )[0].outputs
    assert len(free.token_ids) == 20 and free.finish_reason == "length"
    end = tok.encode("<|close|>think<|sep|><|open|>response<|sep|>", allow_special=True)
    assert free.token_ids[4 : 4 + len(end)] != end  # unconstrained: no default budget


def test_budget_without_constraint(llm, think_prompt):
    tok = llm.tokenizer
    end = tok.encode("<|close|>think<|sep|><|open|>response<|sep|>", allow_special=True)
    sp = SamplingParams(
        n=4,
        max_tokens=30,
        seed=1,
        ignore_eos=True,
        reasoning_end=THINK_END,
        thinking_token_budget=6,
        skip_special_tokens=False,
    )
    forced = 0
    for c in llm.generate([think_prompt], sp, use_tqdm=False)[0].outputs:
        reasoning, rest = split_reasoning(tok, c.token_ids)
        assert c.finish_reason == "length" and len(reasoning) <= 6
        if len(reasoning) == 6:  # else a control token ended the reasoning by itself
            assert rest[: len(end)] == end
            forced += 1
    assert forced


def test_grammar_failure_finishes_with_error(llm, monkeypatch):
    """A token the grammar rejects (here forced past the mask) ends the sequence with "error"."""
    tok = llm.tokenizer
    bad = tok.encode("x")[0]
    orig = llm.engine.runner.execute

    def execute(scheduled, rows):
        out = orig(scheduled, rows)
        out.token_ids = [
            bad if r.grammar is not None and len(r.output_ids) == 2 else t
            for t, r in zip(out.token_ids, [r for r in rows if r is not None])
        ]
        return out

    monkeypatch.setattr(llm.engine.runner, "execute", execute)
    sp = SamplingParams(n=2, max_tokens=40, seed=1, structured=StructuredOutput.json(BOUNDED))
    outs = llm.generate(["x", [1, 2]], [sp, SamplingParams(max_tokens=4, seed=1)], use_tqdm=False)
    for c in outs[0].outputs:
        assert c.finish_reason == "error" and len(c.token_ids) == 3 and c.token_ids[-1] == bad
        assert c.stop_reason.startswith("structured output failed: ")
    assert outs[1].outputs[0].finish_reason == "length"  # unconstrained neighbour unaffected
    assert not llm.engine.grammars
    llm.check_integrity()


def test_precompile_refuses_before_queueing(llm):
    before = llm.stats()["requests_added"]
    with pytest.raises(InvalidRequestError, match="no finite JSON value"):
        llm.engine.precompile(SamplingParams(structured=StructuredOutput.json(SELF)))
    with pytest.raises(InvalidRequestError, match="no finite JSON value"):
        llm.generate(["x"], SamplingParams(structured=StructuredOutput.json(LOOP)), use_tqdm=False)
    assert llm.stats()["requests_added"] == before and not llm.engine.grammars
    errors = []

    def worker():
        try:
            llm.engine.precompile(SamplingParams(structured=StructuredOutput.json(BOUNDED)))
        except Exception as e:  # reported by the assert below
            errors.append(e)

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors


@pytest.mark.parametrize(
    "pattern,size",
    [("^a{3000000}$", 3_000_000), ("^(a{1000}b){1000}$", 1_001_000), ("^a{1000}{1000}$", 1_000_000)],
)
def test_counted_repetitions_too_large_are_refused_before_decoding(pattern, size):
    """llguidance takes these and fails only once decoding enters the string (a 500 then)."""
    assert pattern_size(pattern) == size
    with pytest.raises(StructuredOutputError, match=f"too large for the grammar engine .*about {size} items"):
        StructuredOutput.json({"type": "object", "properties": {"s": {"type": "string", "pattern": pattern}}})


def test_patterns_within_bounds_and_data_are_kept():
    for pattern, size in (("^[a-z]{1,64}@x\\.com$", 70), ("\\{3000000}", 9), ("[{]{5}", 5), ("(ab|cd){20}", 80)):
        assert pattern_size(pattern) == size
        StructuredOutput.json({"type": "string", "pattern": pattern})
    long_alternation = "^(" + "|".join(f"w{i}x" for i in range(2000)) + ")$"  # long, but no repetition
    StructuredOutput.json({"type": "string", "pattern": long_alternation})
    StructuredOutput.json({"const": {"pattern": "^a{3000000}$"}})  # data, not a schema keyword
