"""The CPU weights' huge-page arena (`model.huge_pages`): byte copies in one advised mapping."""

import os

import pytest
import torch

from deltaserve.model import huge_pages, load_model
from deltaserve.tiny import make_tiny

needs_proc = pytest.mark.skipif(
    not (os.path.exists("/proc/self/smaps") and huge_pages.huge_pages_enabled()),
    reason="needs /proc/self/smaps and a kernel with transparent huge pages",
)


def _advised_ranges() -> list[tuple[int, int]]:
    """Address ranges whose VmFlags carry `hg` (MADV_HUGEPAGE), whether or not THP backs them."""
    out, cur = [], None
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                cur = tuple(int(v, 16) for v in head.split("-"))
            elif head == "VmFlags:" and "hg" in line.split()[1:]:
                out.append(cur)
    return out


def _in(t: torch.Tensor, ranges) -> bool:
    return any(lo <= t.data_ptr() and t.data_ptr() + t.numel() * t.element_size() <= hi for lo, hi in ranges)


@needs_proc
def test_place_weights_copies_bytes_into_one_advised_arena():
    g = torch.Generator().manual_seed(0)
    a = torch.randn(300, 7, generator=g).to(torch.bfloat16)
    codes = torch.randint(0, 256, (3, 5, 16), dtype=torch.uint8, generator=g)
    strided = torch.randn(8, 8, generator=g).t()
    tensors = {"a": a, "tied": a, ("experts", 0): codes, "f32": torch.randn(5, generator=g), "strided": strided}
    want = {k: v.clone() for k, v in tensors.items()}
    huge_pages.place_weights(tensors)
    assert tensors["tied"] is tensors["a"] and tensors["a"] is not a  # one copy for one object
    assert tensors["strided"] is strided  # left as it is
    moved = [tensors[k] for k in ("a", ("experts", 0), "f32")]
    for k, v in tensors.items():
        assert v.dtype == want[k].dtype and torch.equal(v, want[k]), k
    ptrs = sorted(t.data_ptr() for t in moved)
    base = min(ptrs)
    assert base % huge_pages.HUGE_PAGE == 0 and all(p % huge_pages.ALIGN == 0 for p in ptrs)
    assert moved[0].untyped_storage().data_ptr() == moved[1].untyped_storage().data_ptr()  # one arena
    assert all(_in(t, _advised_ranges()) for t in moved)


def test_place_weights_is_skipped_when_off_or_too_large(monkeypatch):
    """Decided by the switch, MemAvailable and the kernel's answer (all faked: any host)."""
    t = torch.ones(1000)
    monkeypatch.setenv("DELTASERVE_HUGE_PAGES", "0")
    assert not huge_pages.huge_pages_enabled() and huge_pages.place_weights({"t": t})["t"] is t
    monkeypatch.setattr(huge_pages, "huge_pages_enabled", lambda: True)
    monkeypatch.setattr(huge_pages, "huge_page_bytes", lambda n: torch.zeros(n, dtype=torch.uint8))
    monkeypatch.setattr(huge_pages, "available_bytes", lambda: 4096)
    assert huge_pages.place_weights({"t": t})["t"] is t
    monkeypatch.setattr(huge_pages, "available_bytes", lambda: 1 << 30)
    moved = huge_pages.place_weights({"t": t})["t"]
    assert moved is not t and torch.equal(moved, t)

    def refused(nbytes):
        raise OSError(22, "Invalid argument")

    monkeypatch.setattr(huge_pages, "huge_page_bytes", refused)  # a kernel refusing the advice
    assert huge_pages.place_weights({"t": t})["t"] is t


@needs_proc
@pytest.mark.parametrize("mxfp4", [False, True], ids=["bf16", "mxfp4"])
def test_loaded_cpu_weights_live_in_the_arena_with_the_same_values(tmp_path, monkeypatch, mxfp4):
    path = make_tiny(tmp_path / "k3", "kimi_k3", mxfp4=mxfp4, seed=3)
    placed = load_model(path, progress=False)
    monkeypatch.setenv("DELTASERVE_HUGE_PAGES", "0")
    mapped = load_model(path, progress=False)
    ranges = _advised_ranges()
    got, want = dict(placed.named_parameters()), dict(mapped.named_parameters())
    got.update(placed.named_buffers())
    want.update(mapped.named_buffers())
    assert set(got) == set(want)
    for name, t in got.items():
        assert torch.equal(t, want[name]), name
        assert _in(t, ranges) and not _in(want[name], ranges), name
    assert any(n.endswith("w1_packed") for n in got) == mxfp4
