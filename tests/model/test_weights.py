"""The checkpoint loader (spec/model.md §15-16): `make_tiny` checkpoints load back bit-exactly
against an expectation derived here from the raw safetensors (experts stacked, MXFP4 through the
naive reference decoder, `A_log` unpadded/flattened, fp32 kept fp32); single-file and sharded
forms agree; vision tensors are skipped unread; and bf16/fp32 tensors that need no conversion
stay memory-mapped (malformed checkpoints: test_weight_errors.py)."""

import json
import logging
import os
import re
import shutil
from collections import defaultdict

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from deltaserve.model import load_model
from deltaserve.model import weights as weights_mod
from deltaserve.ops.reference.mxfp4 import naive_mxfp4_decode
from deltaserve.tiny import make_tiny

K3L = "language_model.model.layers."
BITS = {torch.bfloat16: torch.int16, torch.float32: torch.int32, torch.uint8: torch.uint8}
CASES = [("kimi_k3", False), ("kimi_k3", True), ("kimi_linear", False), ("kimi_linear", True)]
EXPERT = re.compile(r"(.*\.experts)\.(\d+)\.(w[123])\.(weight|weight_packed|weight_scale)")


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(BITS[a.dtype]), b.view(BITS[b.dtype]))


def read_raw(path) -> dict[str, torch.Tensor]:
    index = path / "model.safetensors.index.json"
    files = (
        sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.is_file() else ["model.safetensors"]
    )
    out = {}
    for fname in files:
        with safe_open(str(path / fname), framework="pt") as f:
            out.update({k: f.get_tensor(k).clone() for k in f.keys()})
    return out


_DECODED: dict[tuple, torch.Tensor] = {}


def decoded(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The naive float64 decode, memoised (it is a per-element Python loop)."""
    key = (packed.numpy().tobytes(), scale.numpy().tobytes(), tuple(packed.shape))
    if key not in _DECODED:
        _DECODED[key] = naive_mxfp4_decode(packed, scale)
    return _DECODED[key]


def expected_params(raw: dict, family: str, dtype: torch.dtype, heads: int) -> dict[str, torch.Tensor]:
    """Model parameter name -> the tensor it must hold, derived from the raw checkpoint tensors."""
    out, experts = {}, defaultdict(dict)
    for name, t in raw.items():
        if family == "kimi_k3":
            if name.startswith(("vision_tower.", "mm_projector.")):
                continue
            assert name.startswith("language_model."), name
            name = name[len("language_model.") :]
        m = EXPERT.fullmatch(name)
        if m:
            experts[(m[1], m[3])].setdefault(int(m[2]), {})[m[4]] = t
            continue
        if name.endswith(".A_log"):
            t = t.reshape(-1)[:heads]  # K3 [2H] zero-padded, Kimi-Linear [1, 1, H, 1]
        out[name] = t if t.dtype == torch.float32 else t.to(dtype)
    for (prefix, proj), per in experts.items():
        ws = []
        for e in range(len(per)):
            p = per[e]
            w = decoded(p["weight_packed"], p["weight_scale"]) if "weight_packed" in p else p["weight"]
            ws.append(w.to(dtype))
        out[f"{prefix}.{proj}"] = torch.stack(ws)
    return out


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("weights")
    return {(fam, mx): make_tiny(root / f"{fam}{'-mx' if mx else ''}", fam, mxfp4=mx, seed=2) for fam, mx in CASES}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("case", CASES[:3], ids=lambda c: f"{c[0]}{'-mxfp4' if c[1] else ''}")
def test_loads_bit_exactly(ckpts, case, dtype):
    family, mxfp4 = case
    path = ckpts[case]
    raw = read_raw(path)
    assert any(k.endswith(".weight_packed") for k in raw) == mxfp4
    model = load_model(path, dtype=dtype, progress=False, moe_weights="dequantized")
    heads = model.config.kda.num_heads
    want = expected_params(raw, family, dtype, heads)
    got = dict(model.named_parameters())
    assert set(got) == set(want)
    for name, p in got.items():
        assert p.device.type == "cpu" and not p.requires_grad, name
        assert same_bits(p.data, want[name]), name
    a_log = "model.layers.0.self_attn.A_log"
    raw_a_log = raw[("language_model." if family == "kimi_k3" else "") + a_log]
    assert tuple(raw_a_log.shape) == ((2 * heads,) if family == "kimi_k3" else (1, 1, heads, 1))
    assert got[a_log].shape == (heads,) and got[a_log].dtype == torch.float32
    assert got["model.layers.0.self_attn.dt_bias"].dtype == torch.float32  # never downcast
    assert got["model.norm.weight"].dtype == dtype and not model.training
    if mxfp4:  # the default keeps the checkpoint's bytes, validated, packed
        packed = load_model(path, dtype=dtype, progress=False, moe_weights="packed")
        buffers = dict(packed.named_buffers())
        prefix = "language_model." if family == "kimi_k3" else ""
        n_experts = model.config.moe.num_experts
        stacked = [n for n in want if ".experts.w" in n]
        assert stacked
        for name in stacked:
            for part in ("packed", "scale"):
                raw_stack = torch.stack(
                    [
                        raw[f"{prefix}{name.rpartition('.')[0]}.{e}.{name.rpartition('.')[2]}.weight_{part}"]
                        for e in range(n_experts)
                    ]
                )
                assert same_bits(buffers[f"{name}_{part}"], raw_stack), name
        dense = {n: p for n, p in packed.named_parameters()}
        assert set(dense) == set(want) - set(stacked)
        assert all(same_bits(p.data, want[n]) for n, p in dense.items())


def test_mxfp4_and_bf16_variants_load_the_same_model(ckpts):
    """Packing is decided by suffix: MXFP4 experts in a Kimi-Linear file load too (the bf16
    variants are checked bit-exactly above, so this pins the packed ones)."""
    for family in ("kimi_k3", "kimi_linear"):
        a = load_model(ckpts[(family, False)], dtype=torch.float32, progress=False).state_dict()
        b = load_model(
            ckpts[(family, True)], dtype=torch.float32, progress=False, moe_weights="dequantized"
        ).state_dict()
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def write_single(src, dst, edit=None, drop_index=True):
    """Copy src's config into dst with all tensors in one `model.safetensors`, after edit(dict)."""
    dst.mkdir(parents=True, exist_ok=True)
    shutil.copy(src / "config.json", dst / "config.json")
    tensors = read_raw(src)
    if edit is not None:
        edit(tensors)
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def state(path, dtype=torch.float32):
    return load_model(path, dtype=dtype, progress=False).state_dict()


def assert_same(a, b):
    assert a.keys() == b.keys() and all(same_bits(a[k], b[k]) for k in a)


@pytest.mark.parametrize("case", [("kimi_k3", True), ("kimi_linear", False)], ids=["k3-mxfp4", "kl"])
def test_single_file_equals_sharded(ckpts, case, tmp_path):
    single = write_single(ckpts[case], tmp_path / "single")
    assert not (single / "model.safetensors.index.json").exists()
    assert_same(state(single, torch.bfloat16), state(ckpts[case], torch.bfloat16))


def test_k3_older_names_without_inner_model(ckpts, tmp_path):
    """`language_model.layers.…` (dumps that drop the inner `model.`) map to the same parameters."""

    def rename(t):
        for k in [k for k in t if k.startswith(K3L)]:
            t["language_model.layers." + k[len(K3L) :]] = t.pop(k)

    path = write_single(ckpts[("kimi_k3", False)], tmp_path / "old", rename)
    assert_same(state(path), state(ckpts[("kimi_k3", False)]))


class RecordingOpen:
    """Wraps safe_open, recording every tensor read."""

    def __init__(self, reads):
        self.reads = reads

    def __call__(self, *args, **kwargs):
        handle = safe_open(*args, **kwargs)
        reads = self.reads

        class Handle:
            def __enter__(self):
                self.f = handle.__enter__()
                return self

            def __exit__(self, *exc):
                return handle.__exit__(*exc)

            def keys(self):
                return self.f.keys()

            def get_tensor(self, name):
                reads.append(name)
                return self.f.get_tensor(name)

        return Handle()


def test_vision_tensors_skipped_unread_with_a_log_line(ckpts, caplog, monkeypatch):
    path = ckpts[("kimi_k3", True)]
    raw = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
    vision = [k for k in raw if k.startswith(("vision_tower.", "mm_projector."))]
    assert vision
    reads = []
    monkeypatch.setattr(weights_mod, "safe_open", RecordingOpen(reads))
    with caplog.at_level(logging.INFO, logger="deltaserve.model.weights"):
        load_model(path, progress=False)
    assert sorted(reads) == sorted(k for k in raw if k not in vision)  # each text tensor once
    assert any("vision" in r.getMessage() and str(len(vision)) in r.getMessage() for r in caplog.records)


def _mapped_ranges(paths):
    names = {str(p.resolve()) for p in paths}
    out = []
    with open("/proc/self/maps") as maps:
        for line in maps:
            parts = line.split()
            if len(parts) >= 6 and parts[5] in names:
                lo, hi = (int(v, 16) for v in parts[0].split("-"))
                out.append((lo, hi, parts[1]))
    return out


def _is_mapped(t, ranges):
    return any(lo <= t.data_ptr() < hi for lo, hi, _ in ranges)


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="needs /proc/self/maps")
def test_tensors_needing_no_conversion_stay_memory_mapped(ckpts, monkeypatch):
    """Without the huge-page arena (`model.huge_pages`, its own tests) weights are not copied."""
    monkeypatch.setenv("DELTASERVE_HUGE_PAGES", "0")
    path = ckpts[("kimi_k3", False)]
    shards = sorted(path.glob("*.safetensors"))
    bf16 = load_model(path, dtype=torch.bfloat16, progress=False)
    p = dict(bf16.named_parameters())
    ranges = _mapped_ranges(shards)
    assert ranges and all(perm[1] != "w" or perm[3] == "p" for *_, perm in ranges)  # private mappings
    for name in (
        "model.embed_tokens.weight",
        "lm_head.weight",
        "model.layers.0.self_attn.dt_bias",
        "model.layers.0.self_attn.A_log",
        "model.layers.3.self_attn.kv_b_proj.weight",
    ):
        assert _is_mapped(p[name], ranges), name
    assert not _is_mapped(p["model.layers.1.block_sparse_moe.experts.w1"], ranges)  # stacked copy
    fp32 = dict(load_model(path, dtype=torch.float32, progress=False).named_parameters())
    ranges = _mapped_ranges(shards)
    assert not _is_mapped(fp32["model.embed_tokens.weight"], ranges)  # bf16 -> fp32 copy
    assert _is_mapped(fp32["model.layers.0.self_attn.dt_bias"], ranges)  # saved fp32
    before = read_raw(path)["language_model.model.embed_tokens.weight"]
    p["model.embed_tokens.weight"].data[0, 0] += 1  # copy-on-write
    assert torch.equal(read_raw(path)["language_model.model.embed_tokens.weight"], before)


def test_dtype_names_accepted(ckpts):
    model = load_model(ckpts[("kimi_linear", False)], dtype="fp32", progress=False)
    assert model.dtype == torch.float32
    with pytest.raises(ValueError, match="dtype"):
        load_model(ckpts[("kimi_linear", False)], dtype="int8", progress=False)
