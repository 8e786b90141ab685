"""Forced tool calls with tool schemas that use local `$ref`s (`$defs`, `definitions`, `#`):
`tool_choice` "required" (the schemas sit inside the array-of-calls schema, so their references
are rebased) and a named function, streamed and not, over HTTP; every complete call's
arguments validate against the tool's original schema (`jsonschema`, an independent validator).

Schemas: pydantic-generated ones (what `openai.pydantic_function_tool` and most Python agent
frameworks send: `$defs` + `$ref`, a recursive model's root `$ref`) and hand-written recursive
cases. `bfcl-eval` (checked: 2026.3.23 and 2025.6.8) ships no tool schema with a `$ref`, so none
is taken from it."""

import json

import pytest

jsonschema = pytest.importorskip("jsonschema")
openai = pytest.importorskip("openai")
pydantic = pytest.importorskip("pydantic")

from deltaserve.engine.request.structured import tool_call_schema  # noqa: E402
from tests.server.live_server import KEY, MODEL, idle_and_clean, live_server  # noqa: E402

CLOSED = pydantic.ConfigDict(extra="forbid")  # additionalProperties false: calls end


class Item(pydantic.BaseModel):
    model_config = CLOSED
    sku: int = pydantic.Field(ge=0, le=99)
    gift: bool


class Address(pydantic.BaseModel):
    model_config = CLOSED
    country: str = pydantic.Field(json_schema_extra={"enum": ["FR", "NO"]})


class Order(pydantic.BaseModel):
    model_config = CLOSED
    items: list[Item] = pydantic.Field(min_length=1, max_length=2)
    ship_to: Address


class Node(pydantic.BaseModel):
    model_config = CLOSED
    leaf: bool
    kids: list["Node"] = pydantic.Field(default_factory=list, max_length=2)


SELF = {  # the root refers to itself
    "type": "object",
    "properties": {
        "n": {"type": "integer", "minimum": 0, "maximum": 9},
        "kids": {"type": "array", "maxItems": 2, "items": {"$ref": "#"}},
    },
    "required": ["n"],
    "additionalProperties": False,
}
NESTED_DEFS = {  # $defs inside a $defs entry
    "$defs": {
        "Outer": {
            "$defs": {
                "Inner": {
                    "type": "object",
                    "properties": {"on": {"type": "boolean"}},
                    "required": ["on"],
                    "additionalProperties": False,
                }
            },
            "type": "object",
            "properties": {"inner": {"$ref": "#/$defs/Outer/$defs/Inner"}},
            "required": ["inner"],
            "additionalProperties": False,
        }
    },
    "type": "object",
    "properties": {"outer": {"$ref": "#/$defs/Outer"}},
    "required": ["outer"],
    "additionalProperties": False,
}
DEFINITIONS = {  # draft-07 `definitions`, a ref to a ref, `$ref`-looking data left alone
    "$schema": "http://json-schema.org/draft-07/schema#",
    "definitions": {"Color": {"$ref": "#/definitions/Primary"}, "Primary": {"enum": ["red", "blue"]}},
    "type": "object",
    "properties": {
        "color": {"$ref": "#/definitions/Color"},
        "tag": {"const": {"$ref": "#/definitions/Color"}},
    },
    "required": ["color", "tag"],
    "additionalProperties": False,
}
OTHER_ITEM = {  # the same $defs name as Order's, another shape
    "$defs": {
        "Item": {
            "type": "object",
            "properties": {"kg": {"enum": [1, 2]}},
            "required": ["kg"],
            "additionalProperties": False,
        }
    },
    "type": "object",
    "properties": {"load": {"$ref": "#/$defs/Item"}},
    "required": ["load"],
    "additionalProperties": False,
}
SCHEMAS = {
    "order": Order.model_json_schema(),
    "tree": Node.model_json_schema(),
    "self": SELF,
    "nested_defs": NESTED_DEFS,
    "definitions": DEFINITIONS,
    "other_item": OTHER_ITEM,
}
NOTHINK = {"thinking": False}
USER = [{"role": "user", "content": "Call a tool."}]


def tool(name: str) -> dict:
    return {"type": "function", "function": {"name": name, "parameters": SCHEMAS[name]}}


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    with live_server(tmp_path_factory, MODEL, dict(api_key=KEY), max_model_len=2048) as srv:
        yield openai.OpenAI(base_url=srv["url"] + "/v1", api_key=KEY, max_retries=0, timeout=120)
        idle_and_clean(srv["engine"])


def test_the_pydantic_schemas_use_refs():
    assert "$ref" in json.dumps(SCHEMAS["order"]) and "$defs" in SCHEMAS["order"]
    assert SCHEMAS["tree"]["$ref"] == "#/$defs/Node"


def test_rebased_schema_keeps_data_and_resolves_refs():
    wrapped = tool_call_schema([tool("definitions"), tool("other_item")])
    first = wrapped["items"]["anyOf"][0]["properties"]["parameters"]
    assert first["properties"]["tag"] == DEFINITIONS["properties"]["tag"]  # data: untouched
    assert first["definitions"]["Color"] == {"$ref": "#/items/anyOf/0/properties/parameters/definitions/Primary"}
    call = {"name": "other_item", "parameters": {"load": {"kg": 2}}}
    jsonschema.validate([call], wrapped)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "other_item", "parameters": {"load": {"kg": 3}}}], wrapped)


def _calls(client, stream: bool, **kw) -> list[tuple[str, list]]:
    """(finish_reason, [(name, arguments text)]) per choice."""
    if not stream:
        r = client.chat.completions.create(**kw)
        return [
            (c.finish_reason, [(t.function.name, t.function.arguments) for t in c.message.tool_calls or []])
            for c in r.choices
        ]
    calls: dict[int, dict[int, list]] = {}
    finish: dict[int, str] = {}
    for ch in client.chat.completions.create(stream=True, **kw):
        for c in ch.choices:
            for t in c.delta.tool_calls or []:
                slot = calls.setdefault(c.index, {}).setdefault(t.index, [None, ""])
                slot[0] = slot[0] or t.function.name
                slot[1] += t.function.arguments or ""
            if c.finish_reason:
                finish[c.index] = c.finish_reason
    return [(finish[i], [tuple(v) for _, v in sorted(calls.get(i, {}).items())]) for i in sorted(finish)]


def _check(choices, done: str) -> int:
    """Every complete call validates against its tool's original schema; returns how many."""
    complete = 0
    for finish, calls in choices:
        assert finish in (done, "length"), finish
        if finish == done:
            assert calls
            for name, args in calls:
                jsonschema.validate(json.loads(args), SCHEMAS[name])
                complete += 1
    return complete


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("names", [("order", "tree"), ("self", "nested_defs"), ("definitions", "other_item")])
def test_forced_calls_with_ref_schemas(client, names, stream):
    base = dict(model=MODEL, messages=USER, n=4, max_tokens=160, temperature=1.0, extra_body=NOTHINK)
    tools = [tool(n) for n in names]
    required = _calls(client, stream, tools=tools, tool_choice="required", seed=3, **base)
    assert _check(required, "tool_calls") >= 1, required
    for name in names:
        choice = {"type": "function", "function": {"name": name}}
        named = _calls(client, stream, tools=tools, tool_choice=choice, seed=4, **base)
        assert all(n == name for _, calls in named for n, _ in calls)
        assert _check(named, "stop") >= 1, named
