"""`usage.prompt_tokens` against ground truth, on a tiny K3 built on Moonshot's 163,584 base BPE
ranks (`make_tiny(tokenizer_ranks=...)`, ../shared/tokenizers/), so counts equal the real model's.

Ground truths and their sources:
- 36 / 119: the Kimi Vendor Verifier's response-format cases (thinking disabled; the second
  with a json_schema), Moonshot's measured `usage.prompt_tokens`;
- 96: a vendor's preserved-thinking probe (thinking enabled, `keep: "all"`, no effort);
- 147 ids with a fixed SHA-256: a frozen official K3 tokenizer vector (tool declaration, one
  user turn, tool_choice=required, non-thinking generation prompt);
- the rest: prompts spelled out by hand from the public reference encoder's rules and encoded
  segment by segment (`k3_segment_ids`), independently of `chat/k3.py`.
"""

import hashlib
import json
import struct
from pathlib import Path

import httpx
import pytest

from deltaserve import LLM
from deltaserve.chat.render import render_chat
from deltaserve.server.app import build_app
from deltaserve.server.async_engine import AsyncEngine
from deltaserve.tiny import make_tiny
from tests.server.k3.test_chat import k3_segment_ids
from tests.server.live_server import run_app

RANKS = Path(__file__).resolve().parents[4] / "shared" / "tokenizers" / "kimi-base-ranks.tiktoken"
if not RANKS.is_file():
    RANKS = Path("/work/shared/tokenizers/kimi-base-ranks.tiktoken")
MODEL = "k3-ranks"
CAPITAL = "请用 JSON 格式回答：北京是中国的首都吗？答案需要包含键 capital。"
CAPITAL_SCHEMA = {
    "type": "object",
    "properties": {"capital": {"type": "boolean"}},
    "required": ["capital"],
    "additionalProperties": False,
}
WEATHER = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Get current weather for a location",
            "parameters": {
                "type": "object",
                "properties": {"location": {"type": "string", "description": "City name"}},
                "required": ["location"],
            },
        },
    }
]
ORACLE_SHA = "f1ed3971af8259f3b9241d92404ec8d45f34137dec027fd96bc8d23b91b9773c"
PRESERVED = [
    {"role": "user", "content": "随机告诉我三个数"},
    {
        "role": "assistant",
        "reasoning_content": "我先列5个数: 473, 921, 235, 215, 222，告诉用户前三个",
        "content": "473, 921, 235",
    },
    {"role": "user", "content": "告诉我你上一轮的思考过程"},
]

EFFORT_HIGH = (
    "`thinking_effort` guides on how much to think in your thinking channel (not including the response "
    "channel), supported values include `low`, `medium`, `high`, and `max`.\nNow the system is invoked "
    "with `thinking_effort=high`."
)
DYNAMIC = (
    "## New Tools Available\nThe system dynamically extends the toolset via lazy-loading.\nYou have access "
    "to all existing and extended tools.\nHere are the specs for the extended tools.\n\n```json\n"
)

pytestmark = pytest.mark.skipif(not RANKS.is_file(), reason="Moonshot's base ranks are not here")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    ckpt = make_tiny(tmp_path_factory.mktemp("k3r"), family="kimi_k3", vision=False, tokenizer_ranks=RANKS)
    llm = LLM(
        ckpt,
        dtype="float32",
        max_num_seqs=2,
        max_num_batched_tokens=1024,
        page_size=16,
        kv_cache_memory=64 * 2**20,
        progress=False,
        max_model_len=1024,
    )
    engine = AsyncEngine(llm.engine, llm.model.config.family, None)
    try:
        with run_app(build_app(engine, MODEL)) as url:
            yield {"url": url, "tok": llm.tokenizer}
    finally:
        engine.shutdown()


def post(server, body: dict) -> httpx.Response:
    return httpx.post(
        server["url"] + "/v1/chat/completions", json={"model": MODEL, "max_tokens": 1, **body}, timeout=60
    )


def prompt_tokens(server, body: dict) -> int:
    """usage.prompt_tokens over raw HTTP, non-streamed and streamed (they must agree)."""
    r = post(server, body)
    assert r.status_code == 200, r.text
    plain = r.json()["usage"]["prompt_tokens"]
    with httpx.stream(
        "POST",
        server["url"] + "/v1/chat/completions",
        timeout=60,
        json={"model": MODEL, "max_tokens": 1, "stream": True, "stream_options": {"include_usage": True}, **body},
    ) as s:
        lines = [json.loads(x[6:]) for x in s.iter_lines() if x.startswith("data: {")]
    streamed = [c["usage"]["prompt_tokens"] for c in lines if c.get("usage")]
    assert streamed == [plain]
    return plain


def test_tokenizer_is_the_official_one(server):
    tok = server["tok"]
    assert tok.encode("Hello world") == [19180, 2695] and tok.encode("你好世界") == [33845, 2243]
    assert tok.encode("1234567890") == [6694, 12972, 16242, 15] and tok.encode("fooBAR") == [10570, 44894]


def test_official_tool_choice_vector_ids_exact(server):
    msgs = [{"role": "user", "content": "What's the weather in San Francisco?"}]
    ids = render_chat(
        server["tok"], "kimi_k3", msgs, tools=WEATHER, thinking=False, controls=(("tool_choice", "required"),)
    )
    assert len(ids) == 147
    assert hashlib.sha256(b"".join(struct.pack("<i", t) for t in ids)).hexdigest() == ORACLE_SHA


def test_vendor_ground_truths(server):
    user = [{"role": "user", "content": CAPITAL}]
    assert prompt_tokens(server, {"messages": user, "thinking": {"type": "disabled"}}) == 36
    rf = {"type": "json_schema", "json_schema": {"name": "capital_answer", "schema": CAPITAL_SCHEMA}}
    assert prompt_tokens(server, {"messages": user, "thinking": {"type": "disabled"}, "response_format": rf}) == 119
    assert prompt_tokens(server, {"messages": PRESERVED, "thinking": {"type": "enabled", "keep": "all"}}) == 96
    # the open-source shape gives the same prompt
    assert prompt_tokens(server, {"messages": user, "chat_template_kwargs": {"thinking": False}}) == 36
    tools = {"tools": WEATHER, "tool_choice": "required"}
    msgs = [{"role": "user", "content": "What's the weather in San Francisco?"}]
    assert prompt_tokens(server, {"messages": msgs, "thinking": {"type": "disabled"}, **tools}) == 147 - 3


def _spelled(tok, text: str, thinking: bool) -> int:
    """Prompt tokens of a hand-spelled prompt: its segment-wise ids, less the non-thinking
    response opener Moonshot does not count."""
    return len(k3_segment_ids(tok, text)) - (0 if thinking else 3)


def _msg(attrs: str, body: str) -> str:
    return f"<|open|>message {attrs}<|sep|>{body}<|close|>message<|sep|><|end_of_msg|>"


def test_history_dynamic_tools_and_effort_spelled_out(server):
    tok = server["tok"]
    new_tool = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}
    msgs = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather and time in Paris?"},
        {
            "role": "assistant",
            "content": "",
            "reasoning_content": "need both",
            "tool_calls": [
                {
                    "id": "a",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"location": "Paris", "n": [1,2]}'},
                },
                {
                    "id": "b",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": {"location": "Lyon", "n": [1, 2]}},
                },
            ],
        },
        {"role": "tool", "tool_call_id": "b", "content": "12C"},
        {"role": "tool", "tool_call_id": "a", "content": "10C"},
        {"role": "system", "content": "", "tools": [new_tool]},
        {"role": "user", "content": "And the time?"},
    ]
    declare = json.dumps(WEATHER, separators=(",", ":"), sort_keys=True, ensure_ascii=False)
    dyn = json.dumps([new_tool], separators=(",", ":"), sort_keys=True)

    def arg(k, t, v):
        return f'<|open|>argument key="{k}" type="{t}"<|sep|>{v}<|close|>argument<|sep|>'

    text = (
        _msg(
            'role="system" type="tool-declare"',
            "# Tools\nHere are the available tools, described in JSONSchema.\n\n```json\n" + declare + "\n```",
        )
        + _msg(
            'role="system" type="thinking-effort"',
            EFFORT_HIGH,
        )
        + _msg('role="system"', "Be brief.")
        + _msg('role="user"', "Weather and time in Paris?")
        + _msg(
            'role="assistant"',
            "<|open|>think<|sep|>need both<|close|>think<|sep|><|open|>response<|sep|><|close|>response<|sep|>"
            '<|open|>tools<|sep|><|open|>call tool="get_weather" index="1"<|sep|>'
            + arg("location", "string", "Paris")
            + arg("n", "array", "[1,2]")
            + '<|close|>call<|sep|><|open|>call tool="get_weather" index="2"<|sep|>'
            + arg("location", "string", "Lyon")
            + arg("n", "array", "[1, 2]")
            + "<|close|>call<|sep|><|close|>tools<|sep|>",
        )
        + _msg('role="tool" tool="get_weather" index="1"', "10C")
        + _msg('role="tool" tool="get_weather" index="2"', "12C")
        + _msg(
            'role="system" type="tool-declare"',
            DYNAMIC + dyn + "\n```",
        )
        + _msg('role="user"', "And the time?")
        + '<|open|>message role="assistant"<|sep|><|open|>think<|sep|>'
    )
    body = {"messages": msgs, "tools": WEATHER, "reasoning_effort": "high"}
    assert prompt_tokens(server, body) == _spelled(tok, text, True)
    # thinking off: no think elements, no effort message, the opener not counted
    off = text.replace(
        text[
            text.index('<|open|>message role="system" type="thinking-effort"') : text.index(
                '<|open|>message role="system"<|sep|>Be brief.'
            )
        ],
        "",
    )
    off = off.replace("<|open|>think<|sep|>need both<|close|>think<|sep|>", "").replace(
        "<|open|>think<|sep|>", "<|open|>response<|sep|>"
    )
    body = {**body, "chat_template_kwargs": {"thinking": False}}
    assert prompt_tokens(server, body) == _spelled(tok, off, False)
