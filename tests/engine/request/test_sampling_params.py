"""SamplingParams: vLLM defaults, normalisation, and validation that names field and range."""

import math

import pytest

from deltaserve.engine.request.sampling_params import MAX_LOGPROBS, SamplingParams, SamplingParamsError


def test_defaults():
    p = SamplingParams()
    assert (p.n, p.max_tokens, p.min_tokens, p.temperature, p.top_p, p.top_k, p.min_p) == (1, 16, 0, 1.0, 1.0, 0, 0.0)
    assert (p.seed, p.stop, p.stop_token_ids, p.logprobs) == (None, [], [], None)
    assert (p.ignore_eos, p.include_stop_str_in_output, p.skip_special_tokens) == (False, False, True)
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.0, 0.0, 1.0)
    assert not p.greedy


def test_normalisation():
    p = SamplingParams(
        stop="END", stop_token_ids=(3, 4), top_k=-1, temperature=1, top_p=1, max_tokens=None, min_tokens=100
    )
    assert p.stop == ["END"] and p.stop_token_ids == [3, 4] and p.top_k == 0
    assert isinstance(p.temperature, float) and isinstance(p.top_p, float)
    assert SamplingParams(stop=("a", "b")).stop == ["a", "b"]


def test_greedy():
    assert SamplingParams(temperature=0).greedy
    assert SamplingParams(temperature=0.0, top_p=0.5).greedy
    assert SamplingParams(top_k=1).greedy
    assert not SamplingParams(temperature=0.5, top_k=2).greedy


def test_stop_ids():
    p = SamplingParams(stop_token_ids=[7])
    assert p.stop_ids({1, 2}) == {1, 2, 7}
    assert SamplingParams(stop_token_ids=[7], ignore_eos=True).stop_ids({1, 2}) == {7}


@pytest.mark.parametrize(
    "field,value,fragment",
    [
        ("n", 0, ">= 1"),
        ("n", True, ">= 1"),
        ("n", 1.0, ">= 1"),
        ("max_tokens", 0, ">= 1"),
        ("max_tokens", False, ">= 1"),
        ("max_tokens", "8", ">= 1"),
        ("min_tokens", -1, ">= 0"),
        ("temperature", -0.1, ">= 0"),
        ("temperature", math.nan, ">= 0"),
        ("temperature", math.inf, ">= 0"),
        ("temperature", True, ">= 0"),
        ("temperature", "1", ">= 0"),
        ("temperature", 10**400, ">= 0"),
        ("top_p", 0.0, "(0, 1]"),
        ("top_p", 1.5, "(0, 1]"),
        ("top_p", math.nan, "(0, 1]"),
        ("top_k", -2, ">= 1, or 0 / -1"),
        ("top_k", 2.0, ">= 1, or 0 / -1"),
        ("top_k", True, ">= 1"),
        ("min_p", -0.1, "[0, 1]"),
        ("min_p", 1.1, "[0, 1]"),
        ("seed", 1.5, "seed"),
        ("seed", True, "seed"),
        ("seed", 1 << 64, "seed"),
        ("stop", "", "non-empty"),
        ("stop", ["a", ""], "non-empty"),
        ("stop", [1], "non-empty"),
        ("stop", 5, "non-empty"),
        ("stop_token_ids", [-1], ">= 0"),
        ("stop_token_ids", [True], ">= 0"),
        ("stop_token_ids", 3, ">= 0"),
        ("ignore_eos", 1, "bool"),
        ("include_stop_str_in_output", None, "bool"),
        ("skip_special_tokens", "yes", "bool"),
        ("logprobs", -1, f"[0, {MAX_LOGPROBS}]"),
        ("logprobs", MAX_LOGPROBS + 1, f"[0, {MAX_LOGPROBS}]"),
        ("logprobs", True, f"[0, {MAX_LOGPROBS}]"),
        ("presence_penalty", 2.5, "[-2, 2]"),
        ("frequency_penalty", -2.1, "[-2, 2]"),
        ("frequency_penalty", math.nan, "[-2, 2]"),
        ("repetition_penalty", 0.0, "> 0"),
        ("repetition_penalty", -1.0, "> 0"),
        ("repetition_penalty", math.inf, "> 0"),
    ],
)
def test_rejects(field, value, fragment):
    with pytest.raises(SamplingParamsError) as e:
        SamplingParams(**{field: value})
    assert field in str(e.value) and fragment in str(e.value)
    assert isinstance(e.value, ValueError)


def test_min_tokens_le_max_tokens():
    SamplingParams(min_tokens=16, max_tokens=16)
    with pytest.raises(SamplingParamsError, match=r"min_tokens .*<= max_tokens \(16\)"):
        SamplingParams(min_tokens=17)


def test_accepts_edges():
    SamplingParams(
        top_p=1.0,
        min_p=1.0,
        logprobs=0,
        seed=-(1 << 63),
        presence_penalty=-2,
        frequency_penalty=2,
        repetition_penalty=0.01,
        temperature=0,
        top_k=10**6,
    )
    SamplingParams(logprobs=MAX_LOGPROBS, seed=(1 << 64) - 1)


def test_logit_bias():
    assert SamplingParams(logit_bias={5: 1, 0: -100}).logit_bias == {5: 1.0, 0: -100.0}
    for bad in ({-1: 1.0}, {"5": 1.0}, {True: 1.0}, {5: 101}, {5: math.nan}, [(5, 1.0)]):
        with pytest.raises(SamplingParamsError, match="logit_bias"):
            SamplingParams(logit_bias=bad)
