"""The engine on `TritonOps` (CPU interpreter, or CUDA where present) against the reference
backend: a tiny fp32 K3 checkpoint gives the same greedy tokens, with prefix caching on so the
second prompt restores a KDA checkpoint the first one exported inside its prefill pass and its
MLA attention runs over the cached prefix in the pool (the extend kernel)."""

import pytest
import torch

pytest.importorskip("triton")

from deltaserve import LLM, SamplingParams  # noqa: E402
from deltaserve.kernels.triton import mla, mla_prefill  # noqa: E402
from deltaserve.ops.backends import triton as backend  # noqa: E402
from deltaserve.ops.backends.torch import REFERENCE  # noqa: E402
from deltaserve.ops.backends.triton import TritonOps  # noqa: E402
from deltaserve.tiny import make_tiny  # noqa: E402

pytestmark = pytest.mark.triton


def _run(ckpt, device, triton: bool, monkeypatch):
    monkeypatch.setenv("DELTASERVE_TRITON", "1" if triton else "0")
    llm = LLM(
        ckpt,
        "float32",
        device=str(device),
        max_num_seqs=2,
        page_size=4,
        max_model_len=64,
        kv_cache_memory=8 * 2**20,
        enable_prefix_caching=True,
        prefix_match_unit=8,
        progress=False,
    )
    assert isinstance(llm.model.ops, TritonOps) if triton else llm.model.ops is REFERENCE
    params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    shared = list(range(300, 317))
    tokens = [llm.generate([p], params, use_tqdm=False)[0].outputs[0].token_ids for p in (shared, shared + [5, 6, 7])]
    llm.check_integrity()
    assert llm.cache.prefix_stats()["hits"] >= 1
    return tokens, llm


def _counted(monkeypatch, name, calls, module=backend):
    real = getattr(module, name)

    def wrapped(*args, **kwargs):
        calls.append((name, kwargs.get("export_offsets")))
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, wrapped)


def test_greedy_tokens_equal_the_reference_backend(tmp_path, device, monkeypatch):
    ckpt = make_tiny(tmp_path / "k3", family="kimi_k3", preset="tiny", seed=9)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False
    ref, _ = _run(ckpt, "cpu", False, monkeypatch)
    calls = []
    for name in ("chunk_kda", "conv_step", "recurrent_step"):
        _counted(monkeypatch, name, calls)
    _counted(monkeypatch, "mla_decode_attention", calls, mla)
    for name in ("mla_prefill_attention", "mla_extend_attention"):
        _counted(monkeypatch, name, calls, mla_prefill)
    got, _ = _run(ckpt, device, True, monkeypatch)
    assert got == ref
    assert any(name == "chunk_kda" and offsets and any(offsets) for name, offsets in calls)  # exported in-pass
    kernels = {"chunk_kda", "conv_step", "recurrent_step", "mla_decode_attention"}
    assert {name for name, _ in calls} == kernels | {"mla_prefill_attention", "mla_extend_attention"}


def test_steps_read_the_page_table_not_flat_rows(tmp_path, device, monkeypatch):
    """On the Triton backend MLA attention over a context (decode steps, the prefill over the cached
    prefix) reads pages through the block table: the flat row list (O(context) to plan and send)
    is never built."""
    from deltaserve.cache.forward_batch import ForwardBatch

    ckpt = make_tiny(tmp_path / "k3", family="kimi_k3", preset="tiny", seed=9)
    built = []
    flat = ForwardBatch.read_rows.func

    def recorded(self):
        built.append(self.decode_only)
        return flat(self)

    monkeypatch.setattr(ForwardBatch, "read_rows", property(recorded))
    calls = []
    _counted(monkeypatch, "mla_extend_attention", calls, mla_prefill)
    _, llm = _run(ckpt, device, True, monkeypatch)
    assert llm.stats()["steps"] > 4  # decode steps ran
    assert calls  # a prefill over the cached prefix attended through the pages
    assert built == []
