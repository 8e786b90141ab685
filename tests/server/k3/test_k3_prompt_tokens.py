"""`usage.prompt_tokens` against ground truth, on a tiny K3 built on Moonshot's 163,584 base BPE
ranks (`make_tiny(tokenizer_ranks=...)`, ../shared/tokenizers/), so counts equal the real model's.

Ground truths and their sources:
- 36 / 119: the Kimi Vendor Verifier's response-format cases (thinking disabled; the second
  with a json_schema), Moonshot's measured `usage.prompt_tokens`;
- 96: a vendor's preserved-thinking probe (thinking enabled, `keep: "all"`, no effort);
- 147 ids with a fixed SHA-256: a frozen official K3 tokenizer vector (tool declaration, one
  user turn, tool_choice=required, non-thinking generation prompt);
- the rest: prompts spelled out by hand from the public reference encoder's rules and encoded
  segment by segment (`k3_segment_ids`), independently of `chat/k3.py`. An image is the
  reference block `<|media_begin|>image WxH<|media_content|>` + N `<|media_pad|>` +
  `<|media_end|>` (W x H the size as sent), N from K3's navit resize, 14-pixel patches and
  2 x 2 merge (`navit_tokens`, written here from those facts).

Why a non-thinking count is the rendered prompt less 3 (`<|open|>response<|sep|>`): the public
reference renderers (the model repo's `encoding_k3.build_chat_segments`, as ported by vLLM's
`KimiK3Renderer`, which hands the tokenizer's ids to the engine whole, and by the SGLang / SMG
router encoders) all end a non-thinking generation prompt with that opener, so the model is fed
it. The vendor verifier's response-format test says how Moonshot counts: "the API's
`usage.prompt_tokens` corresponds to tokenism's `total_tokens - pending_tokens`". What
`pending_tokens` holds is not published; leaving out the 3-token opener is what makes 36 (39
rendered) and 119 (122) exact while the thinking-mode 96 counts every rendered id. So the
prompt keeps the opener and only the count leaves it out (`chat.k3.uncounted_prompt_tokens`):
an inference from those numbers, stated nowhere public. Likewise for 96's lack of an effort
message: `build_chat_segments(thinking_effort=None)` renders none, while the tokenizer's
`apply_chat_template` defaults the effort to "max" (as the SGLang router's port notes), which
would render one; 96 is the prompt with none, all counted.
"""

import base64
import hashlib
import io
import json
import math
import struct
from pathlib import Path

import httpx
import pytest
from PIL import Image

from deltaserve import LLM
from deltaserve.chat.render import render_chat
from deltaserve.model.image_processor import ImageProcessor
from deltaserve.server.app import build_app
from deltaserve.server.async_engine import AsyncEngine
from deltaserve.tiny import make_tiny
from tests.server.k3.chat_ids import K3_SPECIALS, k3_segment_ids
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

PATCH_LIMIT = 256
MEDIA = K3_SPECIALS + ("<|media_begin|>", "<|media_content|>", "<|media_end|>")

pytestmark = pytest.mark.skipif(not RANKS.is_file(), reason="Moonshot's base ranks are not here")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    ckpt = make_tiny(tmp_path_factory.mktemp("k3r"), family="kimi_k3", vision=True, tokenizer_ranks=RANKS)
    proc_file = ckpt / "preprocessor_config.json"
    proc = json.loads(proc_file.read_text())
    proc["media_proc_cfg"]["in_patch_limit"] = PATCH_LIMIT  # small, so a 300 x 200 image is scaled
    proc_file.write_text(json.dumps(proc))
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
        with run_app(build_app(engine, MODEL, image_processor=ImageProcessor.from_pretrained(ckpt))) as url:
            yield {"url": url, "tok": llm.tokenizer, "cfg": proc["media_proc_cfg"]}
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
    return len(k3_segment_ids(tok, text, MEDIA)) - (0 if thinking else 3)


def _msg(attrs: str, body: str) -> str:
    return f"<|open|>message {attrs}<|sep|>{body}<|close|>message<|sep|><|end_of_msg|>"


def _arg(k: str, t: str, v: str) -> str:
    return f'<|open|>argument key="{k}" type="{t}"<|sep|>{v}<|close|>argument<|sep|>'


def _declare(tools: list, dynamic: bool = False) -> str:
    head = DYNAMIC if dynamic else "# Tools\nHere are the available tools, described in JSONSchema.\n\n```json\n"
    body = json.dumps(tools, separators=(",", ":"), sort_keys=True, ensure_ascii=False)
    return _msg('role="system" type="tool-declare"', head + body + "\n```")


NEW_TOOL = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}
HISTORY = [
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
    {"role": "system", "content": "", "tools": [NEW_TOOL]},
    {"role": "user", "content": "And the time?"},
]


def history_text(thinking: bool) -> str:
    """`HISTORY` with `WEATHER` declared and effort "high", spelled from the reference rules:
    string arguments keep their literal text, object arguments Python's JSON spacing; results
    in call order, indexed by position; the dynamic tools declared in place; with thinking off
    no think elements and no effort message."""
    think = "<|open|>think<|sep|>need both<|close|>think<|sep|>" if thinking else ""
    calls = (
        '<|open|>tools<|sep|><|open|>call tool="get_weather" index="1"<|sep|>'
        + _arg("location", "string", "Paris")
        + _arg("n", "array", "[1,2]")
        + '<|close|>call<|sep|><|open|>call tool="get_weather" index="2"<|sep|>'
        + _arg("location", "string", "Lyon")
        + _arg("n", "array", "[1, 2]")
        + "<|close|>call<|sep|><|close|>tools<|sep|>"
    )
    return (
        _declare(WEATHER)
        + (_msg('role="system" type="thinking-effort"', EFFORT_HIGH) if thinking else "")
        + _msg('role="system"', "Be brief.")
        + _msg('role="user"', "Weather and time in Paris?")
        + _msg('role="assistant"', think + "<|open|>response<|sep|><|close|>response<|sep|>" + calls)
        + _msg('role="tool" tool="get_weather" index="1"', "10C")
        + _msg('role="tool" tool="get_weather" index="2"', "12C")
        + _declare([NEW_TOOL], dynamic=True)
        + _msg('role="user"', "And the time?")
        + '<|open|>message role="assistant"<|sep|>'
        + ("<|open|>think<|sep|>" if thinking else "<|open|>response<|sep|>")
    )


def test_history_dynamic_tools_and_effort_spelled_out(server):
    body = {"messages": HISTORY, "tools": WEATHER, "reasoning_effort": "high"}
    assert prompt_tokens(server, body) == _spelled(server["tok"], history_text(True), True)


def test_history_thinking_off_spelled_out(server):
    body = {
        "messages": HISTORY,
        "tools": WEATHER,
        "reasoning_effort": "high",
        "chat_template_kwargs": {"thinking": False},
    }
    assert prompt_tokens(server, body) == _spelled(server["tok"], history_text(False), False)


def navit_tokens(cfg: dict, width: int, height: int) -> int:
    """LLM tokens of a `width x height` image on K3: scale = min(1, sqrt(in_patch_limit /
    (max(1, W // p) * max(1, H // p))), the per-side cap), each side int()-truncated, zero-padded
    up to a multiple of p * merge, then one token per merge x merge block of p-pixel patches."""
    p, m, side = cfg["patch_size"], cfg["merge_kernel_size"], cfg["patch_limit_on_one_side"]
    budget = math.sqrt(cfg["in_patch_limit"] / (max(1, width // p) * max(1, height // p)))
    scale = min(1.0, budget, side * p / width, side * p / height)
    w, h = max(1, int(width * scale)), max(1, int(height * scale))
    return math.ceil(w / (p * m)) * math.ceil(h / (p * m))


def png(width: int, height: int) -> dict:
    buf = io.BytesIO()
    Image.new("RGB", (width, height), (200, 30, 90)).save(buf, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    return {"type": "image_url", "image_url": {"url": url}}


def image_block(cfg: dict, width: int, height: int) -> str:
    pads = "<|media_pad|>" * navit_tokens(cfg, width, height)
    return f"<|media_begin|>image {width}x{height}<|media_content|>{pads}<|media_end|>"


def test_image_in_user_message(server):
    """Two images in a user message (thinking on: every id counted); the 300 x 200 one is scaled
    by the patch budget (70 tokens), the 57 x 29 one only padded (6)."""
    cfg = server["cfg"]
    assert (navit_tokens(cfg, 300, 200), navit_tokens(cfg, 57, 29)) == (70, 6)
    content = [{"type": "text", "text": "Compare"}, png(300, 200), {"type": "text", "text": " with"}, png(57, 29)]
    text = (
        _msg('role="user"', "Compare" + image_block(cfg, 300, 200) + " with" + image_block(cfg, 57, 29))
        + '<|open|>message role="assistant"<|sep|><|open|>think<|sep|>'
    )
    assert prompt_tokens(server, {"messages": [{"role": "user", "content": content}]}) == _spelled(
        server["tok"], text, True
    )


def test_image_in_tool_message(server):
    """A tool result carrying an image, thinking off (the opener not counted)."""
    cfg = server["cfg"]
    call = {"id": "s", "type": "function", "function": {"name": "get_weather", "arguments": {"location": "Oslo"}}}
    msgs = [
        {"role": "user", "content": "Radar for Oslo?"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "s", "content": [{"type": "text", "text": "radar:"}, png(120, 90)]},
    ]
    text = (
        _declare(WEATHER)
        + _msg('role="user"', "Radar for Oslo?")
        + _msg(
            'role="assistant"',
            '<|open|>response<|sep|><|close|>response<|sep|><|open|>tools<|sep|><|open|>call tool="get_weather" '
            'index="1"<|sep|>' + _arg("location", "string", "Oslo") + "<|close|>call<|sep|><|close|>tools<|sep|>",
        )
        + _msg('role="tool" tool="get_weather" index="1"', "radar:" + image_block(cfg, 120, 90))
        + '<|open|>message role="assistant"<|sep|><|open|>response<|sep|>'
    )
    body = {"messages": msgs, "tools": WEATHER, "thinking": {"type": "disabled"}}
    assert prompt_tokens(server, body) == _spelled(server["tok"], text, False)
