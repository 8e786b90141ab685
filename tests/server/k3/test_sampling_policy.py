"""`--sampling-policy k3` (server/sampling_policy.py): K3's fixed sampling accepted or left out,
any other value a 400 naming the field, over raw HTTP and the openai client, streamed and not;
the engine samples with the fixed values; off by default; an unknown policy is refused."""

import httpx
import pytest

from deltaserve.serve import add_arguments
from deltaserve.server.app import build_app
from deltaserve.server.protocol import ChatRequest
from deltaserve.server.sampling_policy import apply_policy, k3_fixed
from tests.server.live_server import KEY, MODEL, live_server

openai = pytest.importorskip("openai")
USER = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def vendor(tmp_path_factory):
    with live_server(tmp_path_factory, MODEL, dict(api_key=KEY, sampling_policy="k3"), max_model_len=256) as srv:
        yield srv


def post(srv, stream=False, **body):
    body = {"model": MODEL, "messages": USER, "max_tokens": 1, "stream": stream, **body}
    return httpx.post(
        srv["url"] + "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=60
    )


@pytest.mark.parametrize("stream", [False, True])
def test_fixed_values_and_defaults_accepted(vendor, stream):
    assert post(vendor, stream).status_code == 200
    fixed = dict(temperature=1.0, top_p=0.95, presence_penalty=0, frequency_penalty=0, n=1)
    assert post(vendor, stream, **fixed).status_code == 200
    off = {**fixed, "temperature": 0.6, "thinking": {"type": "disabled"}}
    assert post(vendor, stream, **off).status_code == 200


@pytest.mark.parametrize(
    "body,param",
    [
        (dict(temperature=0.7), "temperature"),
        (dict(temperature=0.6), "temperature"),  # 0.6 is the non-thinking value
        (dict(temperature=1.0, thinking={"type": "disabled"}), "temperature"),
        (dict(top_p=0.9), "top_p"),
        (dict(presence_penalty=0.5), "presence_penalty"),
        (dict(frequency_penalty=-1), "frequency_penalty"),
        (dict(n=2), "n"),
    ],
)
@pytest.mark.parametrize("stream", [False, True])
def test_other_values_are_400(vendor, body, param, stream):
    r = post(vendor, stream, **body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


@pytest.mark.parametrize("stream", [False, True])
def test_openai_client(vendor, stream):
    client = openai.OpenAI(base_url=vendor["url"] + "/v1", api_key=KEY, max_retries=0)
    kw = dict(model=MODEL, messages=USER, max_tokens=1, stream=stream)
    r = client.chat.completions.create(**kw, temperature=1.0, top_p=0.95)
    finish = [c.choices[0].finish_reason for c in r if c.choices] if stream else [r.choices[0].finish_reason]
    assert finish[-1] == "length"
    off = dict(temperature=0.6, extra_body={"thinking": {"type": "disabled"}})
    assert client.chat.completions.create(**{**kw, "stream": False}, **off).choices[0].finish_reason == "length"
    with pytest.raises(openai.BadRequestError, match="temperature") as e:
        client.chat.completions.create(**kw, temperature=0.2)
    assert e.value.param == "temperature"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(**kw, top_p=0.5)
    assert e.value.param == "top_p"


def test_engine_samples_with_the_fixed_values():
    req = ChatRequest(model="m", messages=USER)
    kw = apply_policy("k3", req, {"temperature": 1.0, "n": 1}, thinking=False)
    assert kw["temperature"] == 0.6 and kw["top_p"] == 0.95 and kw["presence_penalty"] == 0.0
    assert apply_policy("open", req, {"temperature": 0.3}, thinking=False) == {"temperature": 0.3}
    assert k3_fixed(True)["temperature"] == 1.0


def test_policy_flag_and_unknown_policy(server):
    import argparse

    p = argparse.ArgumentParser()
    add_arguments(p)
    assert p.parse_args([]).sampling_policy == "open"
    assert p.parse_args(["--sampling-policy", "k3"]).sampling_policy == "k3"
    with pytest.raises(SystemExit):
        p.parse_args(["--sampling-policy", "strict"])
    with pytest.raises(ValueError, match="sampling policy"):
        build_app(server["engine"], MODEL, sampling_policy="strict")
    # off by default: the shared server takes any temperature
    r = httpx.post(
        server["url"] + "/v1/chat/completions",
        json={"model": MODEL, "messages": USER, "max_tokens": 1, "temperature": 0.2},
        headers={"Authorization": f"Bearer {KEY}"},
        timeout=60,
    )
    assert r.status_code == 200


def completion(srv, stream=False, **body):
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 1, "stream": stream, **body}
    return httpx.post(srv["url"] + "/v1/completions", json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=60)


@pytest.mark.parametrize("stream", [False, True])
def test_completions_follow_the_policy(vendor, server, stream):
    """/v1/completions: K3's fixed values or none accepted, either mode's temperature (a raw
    prompt has no thinking switch), anything else a 400 naming the field; the open server takes
    any value."""
    assert completion(vendor, stream).status_code == 200
    for temperature in (1.0, 0.6):
        ok = completion(vendor, stream, temperature=temperature, top_p=0.95, presence_penalty=0, n=1)
        assert ok.status_code == 200, ok.text
    for body, param in [
        (dict(temperature=0.7), "temperature"),
        (dict(top_p=0.5), "top_p"),
        (dict(frequency_penalty=1), "frequency_penalty"),
        (dict(n=2), "n"),
    ]:
        r = completion(vendor, stream, **body)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    assert completion(server, stream, temperature=0.7, top_p=0.5, n=2).status_code == 200


def test_completions_sample_with_the_fixed_values():
    from deltaserve.server.protocol import CompletionRequest

    kw = apply_policy("k3", CompletionRequest(model="m", prompt="x", temperature=0.6), {}, thinking=None)
    assert kw["temperature"] == 0.6 and kw["top_p"] == 0.95 and kw["n"] == 1
    assert apply_policy("k3", CompletionRequest(model="m", prompt="x"), {}, thinking=None)["temperature"] == 1.0
