"""The real server's refusals: API key, malformed bodies (400/404/413/422 with an OpenAI-style
error body), raw and chunked bodies. The `server` fixture is in conftest.py."""

import json

import pytest

from tests.server.live_server import CHAT, CMPL, MAX_LEN, MODEL, TOOLS, USER, http


def test_api_key(server):
    assert http(server, "GET", "/v1/models", key=None).status_code == 401
    r = http(server, "GET", "/v1/models", key="wrong")
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    assert http(server, "GET", "/health", key=None).status_code == 200


BAD = [
    (CMPL, {"prompt": "x"}, 400),  # no model
    (CMPL, {"model": "nope", "prompt": "x"}, 404),
    (CMPL, {"model": MODEL}, 400),
    (CMPL, {"model": MODEL, "prompt": "x", "temperature": "hot"}, 400),
    (CMPL, {"model": MODEL, "prompt": "x", "temperature": -1}, 400),
    (CMPL, {"model": MODEL, "prompt": "x", "top_p": 0}, 400),
    (CMPL, {"model": MODEL, "prompt": "x", "n": 0}, 400),
    (CMPL, {"model": MODEL, "prompt": "x", "n": 1000}, 400),
    (CMPL, {"model": MODEL, "prompt": "x", "max_tokens": 0}, 400),
    (CMPL, {"model": MODEL, "prompt": "x", "max_tokens": "5"}, 400),
    (CMPL, {"model": MODEL, "prompt": "x", "logprobs": 100}, 400),
    (CMPL, {"model": MODEL, "prompt": "x", "stop": ["s"] * 40}, 400),
    (CMPL, {"model": MODEL, "prompt": "x", "stop": [""]}, 400),
    (CMPL, {"model": MODEL, "prompt": "x", "seed": "1"}, 400),
    (CMPL, {"model": MODEL, "prompt": []}, 400),
    (CMPL, {"model": MODEL, "prompt": [10**9]}, 400),
    (CMPL, {"model": MODEL, "prompt": [1] * (MAX_LEN + 1)}, 400),
    (CMPL, {"model": MODEL, "prompt": "x", "stream": "yes"}, 400),
    (CHAT, {"model": MODEL, "messages": []}, 400),
    (CHAT, {"model": MODEL, "messages": [{"role": "wizard", "content": "x"}]}, 400),
    (CHAT, {"model": MODEL, "messages": [{"role": "user", "content": 5}]}, 400),
    (CHAT, {"model": MODEL, "messages": [{"role": "user", "content": ""}]}, 400),
    (CHAT, {"model": MODEL, "messages": "hi"}, 400),
    (CHAT, {"model": MODEL, "messages": USER, "top_logprobs": 2}, 400),
    (CHAT, {"model": MODEL, "messages": USER, "tools": [{"function": {}}]}, 400),
    (CHAT, {"model": MODEL, "messages": USER, "presence_penalty": 5}, 400),
    ("/tokenize", {"prompt": "a", "messages": USER}, 400),
    ("/detokenize", {"tokens": [-1]}, 400),
    ("/detokenize", {"tokens": [10**9]}, 400),
    (CMPL, {"model": MODEL, "prompt": "x", "temperature": 3}, 400),
    (CMPL, {"model": MODEL, "prompt": "x", "top_p": 1.5}, 400),
    (CMPL, {"model": MODEL, "prompt": "x", "min_p": -0.1}, 400),
    (CMPL, {"model": MODEL, "prompt": "x", "top_k": -5}, 400),
    (CMPL, {"model": MODEL, "prompt": "x", "n": 1.5}, 400),
    (CMPL, {"model": MODEL, "prompt": "x", "n": True}, 400),
    (CMPL, {"model": MODEL, "prompt": "x", "logprobs": -1}, 400),
    (CMPL, {"model": MODEL, "prompt": "x", "stop": ["y" * 1000]}, 400),
    (CMPL, {"model": MODEL, "prompt": "x", "stop_token_ids": list(range(100))}, 400),
    (CMPL, {"model": MODEL, "prompt": "x", "repetition_penalty": 0}, 400),
    (CMPL, {"model": MODEL, "prompt": "x", "frequency_penalty": -3}, 400),
    (CMPL, {"model": MODEL, "prompt": "x", "min_tokens": -1}, 400),
    (CMPL, {"model": MODEL, "prompt": "x", "stream_options": {"include_usage": "yes"}}, 400),
    (CMPL, {"model": MODEL, "prompt": "x" * 4000}, 400),  # over max_model_len after encoding
    (CMPL, {"model": 5, "prompt": "x"}, 400),
    (CHAT, {"model": MODEL}, 400),
    (CHAT, {"model": MODEL, "messages": USER, "n": 17}, 400),
    (CHAT, {"model": MODEL, "messages": USER, "top_logprobs": 100, "logprobs": True}, 400),
    (CHAT, {"model": MODEL, "messages": USER, "logprobs": "yes"}, 400),
    (CHAT, {"model": MODEL, "messages": USER, "max_completion_tokens": 0}, 400),
    (CHAT, {"model": MODEL, "messages": USER, "tool_choice": "sometimes"}, 400),
    (CHAT, {"model": MODEL, "messages": USER, "tools": "get_weather"}, 400),
    (CHAT, {"model": MODEL, "messages": USER, "response_format": {"type": "yaml"}}, 400),
    (CHAT, {"model": MODEL, "messages": [{"content": "no role"}]}, 400),
    (CHAT, {"model": MODEL, "messages": ["hi"]}, 400),
    (CHAT, {"model": "other", "messages": USER}, 404),
    (CHAT, {"model": MODEL, "messages": [{"role": "user", "content": "x" * 4000}]}, 400),
    ("/detokenize", {"tokens": "abc"}, 400),
    ("/tokenize", {}, 400),
    # batched completions, echo, suffix
    (CMPL, {"model": MODEL, "prompt": "x", "suffix": "y"}, 400),
    (CMPL, {"model": MODEL, "prompt": "x", "echo": True, "logprobs": 1}, 400),
    (CMPL, {"model": MODEL, "prompt": "x", "echo": "yes"}, 400),
    (CMPL, {"model": MODEL, "prompt": ["a"] * 65}, 400),
    (CMPL, {"model": MODEL, "prompt": ["a"] * 5, "n": 16}, 400),
    (CMPL, {"model": MODEL, "prompt": ["a", ""]}, 400),
    (CMPL, {"model": MODEL, "prompt": [[1, 2], []]}, 400),
    (CMPL, {"model": MODEL, "prompt": [[1, 2], [10**9]]}, 400),
    (CMPL, {"model": MODEL, "prompt": [[1, 2], [1] * (MAX_LEN + 1)]}, 400),
    (CMPL, {"model": MODEL, "prompt": [["a"]]}, 400),
    (CMPL, {"model": MODEL, "prompt": ["a", 1]}, 400),
    (CMPL, {"model": MODEL, "prompt": "x", "response_format": {"type": "json_schema"}}, 400),
    (
        CMPL,
        {
            "model": MODEL,
            "prompt": "x",
            "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}},
        },
        400,
    ),
    # response_format
    (CHAT, {"model": MODEL, "messages": USER, "response_format": {"type": "json_schema"}}, 400),
    (CHAT, {"model": MODEL, "messages": USER, "response_format": {"type": "json_object", "json_schema": 5}}, 400),
    (
        CHAT,
        {"model": MODEL, "messages": USER, "response_format": {"type": "json_schema", "json_schema": {"schema": {}}}},
        400,
    ),
    (
        CHAT,
        {
            "model": MODEL,
            "messages": USER,
            "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": "s"}},
        },
        400,
    ),
    (
        CHAT,
        {
            "model": MODEL,
            "messages": USER,
            "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}},
        },
        400,
    ),
    (
        CHAT,
        {
            "model": MODEL,
            "messages": USER,
            "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#/nope"}}},
        },
        400,
    ),
    (
        CHAT,
        {
            "model": MODEL,
            "messages": USER,
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"type": "string", "pattern": "("}},
            },
        },
        400,
    ),
    (CHAT, {"model": MODEL, "messages": USER, "response_format": "json_object"}, 400),
    # tool_choice and control fields
    (CHAT, {"model": MODEL, "messages": USER, "tool_choice": "required"}, 400),
    (
        CHAT,
        {
            "model": MODEL,
            "messages": USER,
            "tools": TOOLS,
            "tool_choice": {"type": "function", "function": {"name": "nope"}},
        },
        400,
    ),
    (
        CHAT,
        {"model": MODEL, "messages": USER, "tool_choice": {"type": "function", "function": {"name": "get_weather"}}},
        400,
    ),
    (CHAT, {"model": MODEL, "messages": USER, "tools": TOOLS, "tool_choice": {"type": "function"}}, 400),
    (
        CHAT,
        {
            "model": MODEL,
            "messages": USER,
            "tools": TOOLS,
            "tool_choice": {"type": "function", "function": {"name": ""}},
        },
        400,
    ),
    (
        CHAT,
        {
            "model": MODEL,
            "messages": USER,
            "tools": TOOLS,
            "tool_choice": {"type": "tool", "function": {"name": "get_weather"}},
        },
        400,
    ),
    (
        CHAT,
        {
            "model": MODEL,
            "messages": USER,
            "tools": TOOLS,
            "tool_choice": "required",
            "response_format": {"type": "json_object"},
        },
        400,
    ),
    (
        CHAT,
        {
            "model": MODEL,
            "messages": USER,
            "tools": [
                {"type": "function", "function": {"name": "f", "parameters": {"type": "integer", "minimum": "a"}}}
            ],
            "tool_choice": {"type": "function", "function": {"name": "f"}},
        },
        400,
    ),
    (
        CHAT,
        {"model": MODEL, "messages": USER, "tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": "no"},
        400,
    ),
    (CHAT, {"model": MODEL, "messages": USER, "reasoning_effort": "extreme"}, 400),
    (CHAT, {"model": MODEL, "messages": USER, "thinking_effort": 3}, 400),
]


@pytest.mark.parametrize("path,body,status", BAD, ids=[f"{i}" for i in range(len(BAD))])
def test_malformed_request(server, path, body, status):
    r = http(server, "POST", path, json=body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    ok = http(server, "POST", CMPL, json={"model": MODEL, "prompt": "ok", "max_tokens": 2})
    assert ok.status_code == 200 and ok.json()["choices"][0]["finish_reason"]


@pytest.mark.parametrize(
    "content,status",
    [
        (b"{not json", 400),
        (b"[1, 2]", 400),
        (b'{"model": "tiny-k3", "prompt": "x", "temperature": NaN}', 400),
        (b"x" * (2 << 20), 413),
    ],
)
def test_raw_bodies(server, content, status):
    r = http(server, "POST", CMPL, content=content, headers={"Content-Type": "application/json"})
    assert r.status_code == status and "error" in r.json()
    assert http(server, "GET", "/nope").status_code == 404
    assert http(server, "GET", CMPL).status_code == 405


def test_chunked_body_cap(server):
    """No Content-Length (chunked): the cap is enforced while the body streams in."""

    def chunks(n, size=1 << 16):
        for _ in range(n):
            yield b" " * size

    r = http(server, "POST", CMPL, content=chunks(64), headers={"Content-Type": "application/json"})
    assert r.status_code == 413 and "over" in r.json()["error"]["message"]
    body = json.dumps({"model": MODEL, "prompt": "ok", "max_tokens": 2}).encode()
    ok = http(server, "POST", CMPL, content=iter([body[:10], body[10:]]), headers={"Content-Type": "application/json"})
    assert "content-length" not in ok.request.headers and ok.status_code == 200, ok.text
