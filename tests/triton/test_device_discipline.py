"""A step of the engine on `TritonOps` neither stalls nor mixes devices: the host never reads a
device value (beyond the sampler's output) nor makes a blocking copy, and no op meets host and
device tensors. Without CUDA this runs under `FakeDevice` (which sees what CUDA would do); on CUDA
under torch's sync debug mode. The workload (`step_workload`) takes every path of a step, the
vision encoder included."""

import pytest
import torch

pytest.importorskip("triton")

from PIL import Image  # noqa: E402

from deltaserve import LLM  # noqa: E402
from deltaserve.ops.backends.torch import TorchOps  # noqa: E402
from deltaserve.ops.backends.triton import TritonOps  # noqa: E402
from deltaserve.tiny import make_tiny  # noqa: E402

from ..fake_device import FakeDevice, step_workload, watch_steps  # noqa: E402

pytestmark = pytest.mark.triton


def test_fake_device_reports_each_kind(tmp_path):
    """The check can fail: one offending call of each kind, from a file under the package."""
    source = tmp_path / "pkg" / "offender.py"
    source.parent.mkdir()
    source.write_text(
        "def run(torch):\n"
        "    d = torch.zeros(4, device=torch.device('cpu'))\n"
        "    h = torch.arange(4)\n"
        "    int(d[0]); d.tolist(); torch.bincount(d.long()); d[d > 0]\n"
        "    h.to(d.device); torch.tensor([1], device=d.device); d[h]\n"
        "    torch.cat([d, h.float()])\n"
        "    h.to(d.device, non_blocking=True) + d; d.sum()\n"
    )
    scope: dict = {}
    exec(compile(source.read_text(), str(source), "exec"), scope)
    mode = FakeDevice(package="/pkg/")
    with mode:
        mode.active = True
        scope["run"](torch)
    kinds = collections_of(mode.found)
    assert kinds == {
        "sync": {"__int__", "tolist", "bincount", "__getitem__"},
        "h2d": {"to", "tensor", "__getitem__"},
        "mix": {"cat"},
    }
    assert all(site.startswith("offender.py:") for (_, _, site) in mode.found)


def collections_of(found) -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for kind, op, _ in found:
        out.setdefault(kind, set()).add(op)
    return out


def _llm(ckpt, device: str, backend=TritonOps, dtype: str = "float32") -> LLM:
    llm = LLM(
        ckpt, dtype, device=device, max_num_seqs=2, page_size=4, max_model_len=256,
        kv_cache_memory=16 * 2**20, enable_prefix_caching=True, prefix_match_unit=8, progress=False,
    )  # fmt: skip
    assert type(llm.model.ops) is backend
    return llm


def _image():
    g = torch.Generator().manual_seed(0)
    return Image.fromarray(torch.randint(0, 256, (30, 44, 3), generator=g, dtype=torch.uint8).numpy())


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # bf16 values in the interpreter
@pytest.mark.parametrize(
    "family, dtype, mxfp4",
    [("kimi_k3", "float32", False), ("kimi_linear", "float32", False), ("kimi_k3", "bfloat16", True)],
)
def test_engine_steps_do_not_stall_or_mix_devices(tmp_path, device, monkeypatch, family, dtype, mxfp4):
    """fp32 (tokens checked against the reference too) and bf16 with packed MXFP4 experts (the
    experts' packed path; tokens not compared: half-precision `tl.dot` is wrong in the interpreter)."""
    monkeypatch.setenv("DELTASERVE_TRITON", "1")
    ckpt = make_tiny(tmp_path / family, family=family, preset="tiny", seed=9, mxfp4=mxfp4)
    image = _image() if family == "kimi_k3" else None
    if device.type == "cuda":
        _on_cuda(ckpt, image, monkeypatch, dtype)
        return
    mode = FakeDevice(allow_sync=("/engine/exec/sampler.py",))
    with mode:
        watch_steps(mode, monkeypatch)
        llm = _llm(ckpt, "cpu:0", dtype=dtype)
        got = step_workload(llm, image)
    assert llm.cache.prefix_stats()["hits"] >= 1
    assert mode.checked > 1000  # the step's tensors were on the fake device
    assert not mode.found, sorted(mode.found.items())
    if dtype != "float32":
        return
    monkeypatch.undo()
    monkeypatch.setenv("DELTASERVE_TRITON", "0")
    assert step_workload(_llm(ckpt, "cpu", TorchOps), image) == got  # the reference backend's tokens


def _on_cuda(ckpt, image, monkeypatch, dtype: str) -> None:
    """Torch's own check on CUDA: a synchronising call in a step, outside the sampler, raises."""
    from deltaserve.engine.exec.runner import ModelRunner

    execute = ModelRunner.execute

    def checked(self, *args, **kwargs):
        sample = self.sampler

        def unchecked_sampler(*a):
            torch.cuda.set_sync_debug_mode(0)
            return sample(*a)

        self.sampler = unchecked_sampler
        torch.cuda.set_sync_debug_mode("error")
        try:
            return execute(self, *args, **kwargs)
        finally:
            torch.cuda.set_sync_debug_mode(0)
            self.sampler = sample

    monkeypatch.setattr(ModelRunner, "execute", checked)
    step_workload(_llm(ckpt, "cuda", dtype=dtype), image)
