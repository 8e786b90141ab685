"""Every speed benchmark runs in-process on tiny checkpoints with `--json` and reports finite,
positive figures under the documented keys; vs-reference agrees exactly in fp32. No assertion
depends on how fast anything ran."""

import json
import math

import pytest
import torch

from deltaserve.cli import main
from deltaserve.tiny import make_tiny

SMALL_ROOF = ["--bandwidth-mib", "4", "--gemm-sizes", "64,128", "--roofline-reps", "1"]
ENGINE = ["--threads", "1", "--kv-cache-memory", str(32 * 2**20)]


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("speed")
    return {f: str(make_tiny(root / f, family=f, preset="tiny", seed=4)) for f in ("kimi_k3", "kimi_linear")}


@pytest.fixture(autouse=True)
def _restore_threads():
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


def bench(capsys, *argv) -> dict:
    assert main(["bench", *argv, "--json"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    out = json.loads(lines[-1])
    assert isinstance(out, dict) and out["meta"]["threads"] == 1
    return out


def positive(out: dict, keys) -> None:
    for k in keys:
        v = out[k]
        assert isinstance(v, (int, float)) and math.isfinite(v) and v > 0, (k, v)


def test_roofline(capsys):
    out = bench(capsys, "roofline", "--threads", "1", *SMALL_ROOF)
    positive(
        out,
        [
            "bandwidth_gb_s",
            "read_sum_gb_s",
            "read_split_gb_s",
            "copy_gb_s",
            "gemm_bf16_gflops",
            "gemm_fp32_gflops",
            "gemm_gflops",
        ],
    )
    assert set(out["gemm_bf16_by_size"]) == set(out["gemm_fp32_by_size"]) == {"64", "128"}
    assert out["device"] == "cpu"  # the figures are for `--device` (a GPU's own with `--device cuda`)


def test_meta_says_whether_huge_pages_hold_the_weights(capsys, monkeypatch):
    on = bench(capsys, "roofline", "--threads", "1", *SMALL_ROOF)["meta"]["huge_pages"]
    assert on == "off" or "[" in on  # the kernel's THP setting, its mode in brackets
    monkeypatch.setenv("DELTASERVE_HUGE_PAGES", "0")
    assert bench(capsys, "roofline", "--threads", "1", *SMALL_ROOF)["meta"]["huge_pages"] == "off"


def test_latency(capsys, ckpts):
    out = bench(
        capsys,
        "latency",
        "--model",
        ckpts["kimi_k3"],
        "--prompt-len",
        "64",
        "--output-len",
        "4",
        "--reps",
        "1",
        *ENGINE,
        *SMALL_ROOF,
    )
    positive(
        out,
        [
            "decode_tok_s",
            "ttft_s",
            "prefill_tok_s",
            "decode_vs_bandwidth_roofline",
            "prefill_vs_gemm_roofline",
            "decode_roofline_tok_s",
            "prefill_roofline_tok_s",
            "decode_bytes_per_token",
            "prefill_flops_per_token",
            "bandwidth_gb_s",
            "gemm_gflops",
        ],
    )
    assert out["decode_bytes"]["context"] == 64 + 2 and out["prefill_flops"]["prompt_len"] == 64
    assert out["paired"] is None


def test_latency_paired_with_bandwidth_readings(capsys, ckpts):
    """`--paired 2`: two more decode runs, each ratio against the mean of its own two readings."""
    out = bench(
        capsys, "latency", "--model", ckpts["kimi_k3"], "--prompt-len", "16", "--output-len", "3", "--reps", "1",
        "--paired", "2", *ENGINE, *SMALL_ROOF,
    )  # fmt: skip
    runs = out["paired"]["runs"]
    assert len(runs) == 2
    for r in runs:
        positive(r, ["decode_tok_s", "bandwidth_gb_s", "roofline_tok_s", "fraction"])
        assert math.isclose(r["roofline_tok_s"], r["bandwidth_gb_s"] * 1e9 / out["decode_bytes_per_token"])
        assert math.isclose(r["fraction"], r["decode_tok_s"] / r["roofline_tok_s"])
    fractions = sorted(r["fraction"] for r in runs)
    assert math.isclose(out["paired"]["median_fraction"], (fractions[0] + fractions[1]) / 2)


def test_throughput(capsys, ckpts):
    out = bench(
        capsys,
        "throughput",
        "--model",
        ckpts["kimi_k3"],
        "--num-prompts",
        "4",
        "--input-len",
        "16",
        "--output-len",
        "3",
        "--concurrency",
        "1,4",
        *ENGINE,
        *SMALL_ROOF,
    )
    assert [r["concurrency"] for r in out["rows"]] == [1, 4] and out["base_concurrency"] == 1
    for r in out["rows"]:
        positive(r, ["wall_s", "output_tok_s", "total_tok_s", "output_vs_base", "total_vs_base"])
        positive(r, ["roofline_output_tok_s", "fraction", "roofline_vs_base", "decode_step_roofline_ms"])
        assert r["num_prompts"] == 4 and r["preemptions"] == 0 and r["decode_limit"] in ("memory", "compute")
        assert math.isclose(r["fraction"], r["output_tok_s"] / r["roofline_output_tok_s"])
    assert out["rows"][0]["output_vs_base"] == 1.0 and out["rows"][0]["roofline_vs_base"] == 1.0
    positive(out, ["output_tok_s_at_max", "output_speedup_at_max", "total_speedup_at_max"])
    positive(out["roofline"], ["bandwidth_gb_s", "gemm_bf16_gflops"])
    one, four = out["rows"]  # 4 prompts of 3 tokens: 2 decode steps each at 1, 2 steps in all at 4
    prefill_s = (4 * 3 / one["roofline_output_tok_s"]) - 4 * 2 * one["decode_step_roofline_ms"] / 1e3
    assert math.isclose(4 * 3 / four["roofline_output_tok_s"], prefill_s + 2 * four["decode_step_roofline_ms"] / 1e3)


def test_throughput_without_roofline(capsys, ckpts):
    args = ["--num-prompts", "2", "--input-len", "8", "--output-len", "2", "--concurrency", "2", "--no-roofline"]
    out = bench(capsys, "throughput", "--model", ckpts["kimi_k3"], *args, *ENGINE)
    assert out["roofline"] is None and "fraction" not in out["rows"][0]


def test_kda_scaling(capsys, ckpts):
    out = bench(
        capsys,
        "kda-scaling",
        "--model",
        ckpts["kimi_k3"],
        "--lengths",
        "64,128",
        "--max-num-batched-tokens",
        "64",
        *ENGINE,
    )
    assert [r["length"] for r in out["rows"]] == [64, 128] and out["length_ratio"] == 2
    for r in out["rows"]:
        positive(r, ["total_s", "tok_s", "kda_s", "mla_s", "moe_s", "mlp_s"])
    for kind in ("kda", "mla", "moe", "mlp", "total"):
        positive(out["ratio"], [kind])
        positive(out["linearity"], [kind])
    positive(out, ["kda_linearity", "mla_linearity"])


@pytest.mark.parametrize("family", ["kimi_k3", "kimi_linear"])
def test_vs_reference_agrees_in_fp32(capsys, ckpts, family):
    out = bench(
        capsys,
        "vs-reference",
        "--model",
        ckpts[family],
        "--num-prompts",
        "2",
        "--input-len",
        "24",
        "--output-len",
        "6",
        *ENGINE,
    )
    assert out["meta"]["dtype"] == "float32" and out["family"] == family
    positive(out, ["engine_s", "engine_tok_s", "reference_s", "reference_tok_s", "speedup_vs_reference"])
    assert out["agreement_vs_reference"] == 1.0
    if family == "kimi_k3":
        assert not out["transformers_available"] and "kimi_k3" in out["transformers_reason"]
    else:
        pytest.importorskip("transformers")
        assert out["transformers_available"], out["transformers_reason"]
        positive(out, ["transformers_s", "transformers_tok_s", "speedup_vs_transformers"])
        assert out["agreement_vs_transformers"] == 1.0


def test_throughput_under_tensor_parallelism_reports_comm_and_ratio(capsys, ckpts):
    args = ["--num-prompts", "2", "--input-len", "16", "--output-len", "3", "--concurrency", "2"]
    out = bench(capsys, "throughput", "--model", ckpts["kimi_k3"], *args, *ENGINE, "--tensor-parallel-size", "2")
    par = out["parallel"]
    assert par["tensor_parallel_size"] == 2 and par["tp1_threads"] == 2 and par["comm_calls"] > out["steps"] > 0
    positive(par, ["comm_s", "comm_ms_per_step", "output_tok_s_at_max_vs_tp1"])
    assert out["roofline"] is None  # ranks share the machine: no one-process roofline


def test_spec_bench_times_decode_with_and_without_drafts(ckpts, capsys):
    """bench spec: a row per workload and batch (resend and self at batch 1), finite positive rates,
    the same tokens with speculation as without, drafts verified on the copy workload."""
    out = bench(
        capsys, "spec", "--model", ckpts["kimi_k3"], "--dtype", "float32", "--threads", "1",
        "--batch-sizes", "1,2", "--repeats", "1", "--output-tokens", "24", "--no-adaptive",
    )  # fmt: skip
    rows = out["rows"]
    assert [(r["workload"], r["batch"]) for r in rows] == [
        ("copy", 1), ("free", 1), ("copy-resend", 1), ("copy-self", 1), ("copy", 2), ("free", 2),
    ]  # fmt: skip
    assert all(r["same_tokens"] for r in rows)
    for r in rows:
        assert all(math.isfinite(r[k]) and r[k] > 0 for k in ("tok_s_off", "tok_s_on", "speedup"))
    self_row = next(r for r in rows if r["workload"] == "copy-self")
    assert self_row["drafted_steps"] > 0 and self_row["acceptance_rate"] > 0.5
