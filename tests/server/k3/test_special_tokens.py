"""Special tokens in chat output: the parsers still see their control markers, the visible text
(content, reasoning_content) carries no other special (reserved, pad, media, ...)."""

import json

import pytest

from deltaserve.engine.request.detokenizer import IncrementalDetokenizer
from deltaserve.engine.request.sampling_params import SamplingParams
from deltaserve.model.tokenizer import Tokenizer
from deltaserve.server.parsers import StreamingParser, collect, control_token_ids
from deltaserve.tiny import make_tiny
from tests.server.live_server import MODEL, idle_and_clean, script_outputs, unguarded

K3_OUT = (
    "need<|reserved_token_1800|> weather<|close|>think<|sep|><|open|>response<|sep|>"
    "check<|media_pad|>ing<|close|>response<|sep|><|open|>tools<|sep|>"
    '<|open|>call tool="get_weather" index="1"<|sep|><|open|>argument key="city" type="string"<|sep|>'
    "Par<|reserved_token_2000|>is<|close|>argument<|sep|><|close|>call<|sep|><|close|>tools<|sep|>"
)
KL_OUT = (
    "<think>hm[PAD]m</think>ok<|reserved_token_1800|>ay<|tool_calls_section_begin|><|tool_call_begin|>"
    'functions.get_weather:0<|tool_call_argument_begin|>{"city": "Paris"}<|tool_call_end|>'
    "<|tool_calls_section_end|>"
)
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]


def run(tok, family, text, every):
    """Detokenize the ids of `text` with a chat request's params, parse the deltas."""
    ids = tok.encode(text, allow_special=True)
    params = SamplingParams(keep_special_token_ids=control_token_ids(tok, family), max_tokens=None)
    detok, parser, out = IncrementalDetokenizer(tok, params), StreamingParser(family, True), []
    for k, i in enumerate(ids, 1):
        detok.append(i)
        if k % every == 0:
            out += parser.feed(detok.delta())
    out += parser.feed(detok.delta(final=True)) + parser.finish()
    return collect(out)


@pytest.mark.parametrize("every", [1, 3, 1000])
def test_k3_specials_dropped_controls_parsed(tmp_path_factory, every):
    tok = Tokenizer.from_pretrained(make_tiny(tmp_path_factory.mktemp("k3"), family="kimi_k3"))
    assert control_token_ids(tok, "kimi_k3") == {
        tok.special_tokens[m] for m in ("<|open|>", "<|close|>", "<|sep|>", "<|end_of_msg|>")
    }
    p = run(tok, "kimi_k3", K3_OUT, every)
    assert (p.reasoning_content, p.content) == ("need weather", "checking")
    [call] = p.tool_calls
    assert (call.name, json.loads(call.arguments_json)) == ("get_weather", {"city": "Paris"})


@pytest.mark.parametrize("every", [1, 4])
def test_kimi_linear_specials_dropped_controls_parsed(tmp_path_factory, every):
    tok = Tokenizer.from_pretrained(make_tiny(tmp_path_factory.mktemp("kl"), family="kimi_linear"))
    p = run(tok, "kimi_linear", KL_OUT, every)
    assert (p.reasoning_content, p.content) == ("hmm", "okay")
    [call] = p.tool_calls
    assert (call.name, json.loads(call.arguments_json)) == ("get_weather", {"city": "Paris"})


@pytest.fixture
def scripted(server):
    """Force the sampled tokens to K3_OUT then EOS (the model still runs every step), unguarded."""
    engine, tok = server["engine"], server["tok"]
    script = tok.encode(K3_OUT, allow_special=True) + [min(engine.core.eos_ids)]
    undo = script_outputs(engine, script)
    with unguarded(server):
        yield
    undo()
    idle_and_clean(engine)


def test_chat_route_hides_reserved_tokens(client, scripted):
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "weather in Paris?"}], tools=TOOLS, max_tokens=200)
    m = client.chat.completions.create(**kw).choices[0].message
    assert (m.reasoning_content, m.content) == ("need weather", "checking")
    [call] = m.tool_calls
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    content = reasoning = ""
    for ch in client.chat.completions.create(stream=True, **kw):
        d = ch.choices[0].delta
        content += d.content or ""
        reasoning += getattr(d, "reasoning_content", None) or ""
    assert (reasoning, content) == ("need weather", "checking")
    plain = client.chat.completions.create(**{**kw, "tool_choice": "none"}).choices[0].message
    assert "<|reserved_token_" not in plain.content and "Paris" in plain.content
    assert "<|open|>call" in plain.content  # undeclared tool markup stays verbatim (serving §7 row 9)
