"""The K3 vision path (spec §12.2-12.5) loaded from the tiny checkpoint against the float64
oracle `ops.reference.vision`: tower, merge and projector outputs, packing, RoPE2D column
order, merge window order, the OQ-5 eps rule and the loader's errors."""

from __future__ import annotations

import json
import math
import shutil
from collections import Counter

import pytest
import torch
from safetensors.torch import load_file, save_file

from deltaserve.model.config import ConfigError
from deltaserve.model.modules import OpsModule
from deltaserve.model.vision import VisionConfig, VisionRMSNorm
from deltaserve.model.vision_weights import PREFIXES, load_vision_model
from deltaserve.model.weights import CheckpointError
from deltaserve.ops import vision as vops
from deltaserve.ops.backends.torch import TorchOps
from deltaserve.ops.norms import rms_norm
from deltaserve.ops.reference import vision as ref
from deltaserve.tiny import make_tiny

FP32_EPS = torch.finfo(torch.float32).eps
ONE = [(1, 4, 6)]
TWO = [(1, 4, 6), (1, 6, 2)]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny(tmp_path_factory.mktemp("k3v"), "kimi_k3", "tiny", seed=5)


@pytest.fixture(scope="module")
def weights64(ckpt):
    """Every vision tensor of the checkpoint, float64."""
    out = {}
    for fname in set(json.loads((ckpt / "model.safetensors.index.json").read_text())["weight_map"].values()):
        out.update({k: v.double() for k, v in load_file(ckpt / fname).items() if k.startswith(PREFIXES)})
    return out


@pytest.fixture(scope="module")
def models(ckpt):
    return {dt: load_vision_model(ckpt, dt) for dt in (torch.float32, torch.bfloat16)}


def _patches(grids, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.rand(sum(t * h * w for t, h, w in grids), 3, 14, 14, generator=g) * 2 - 1


def _rel(a, b):
    return ((a.double() - b).norm() / b.norm()).item()


def test_config_from_checkpoint(ckpt):
    raw = json.loads((ckpt / "config.json").read_text())
    v = raw["vision_config"]
    cfg = VisionConfig.from_dict(raw)
    assert (cfg.hidden_size, cfg.num_layers, cfg.num_heads) == (
        v["vt_hidden_size"],
        v["vt_num_hidden_layers"],
        v["vt_num_attention_heads"],
    )
    assert cfg.head_dim == v["qkv_hidden_size"] // v["vt_num_attention_heads"]
    assert cfg.merged_size == 4 * v["vt_hidden_size"]
    assert (cfg.text_hidden_size, cfg.projector_eps) == (raw["text_config"]["hidden_size"], 1e-5)
    with pytest.raises(ConfigError, match="merge_type"):
        VisionConfig.from_dict(dict(v, merge_type="avgpool"))
    with pytest.raises(ConfigError, match="qkv_hidden_size"):
        VisionConfig.from_dict(dict(v, qkv_hidden_size=30))


@pytest.mark.parametrize("grids", [[(1, 4, 4)], ONE, TWO, [(1, 2, 8), (1, 4, 4), (1, 6, 6)]], ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_matches_float64_reference(models, weights64, grids, dtype):
    """fp32: float32 noise; bf16: bf16 noise; eps = finfo(fp32).eps for both (PyTorch's default)."""
    model, x = models[dtype], _patches(grids).to(dtype)
    eps = FP32_EPS
    want = ref.naive_vision(weights64, x.double(), grids, model.cfg.num_heads, eps, 1e-5)
    with torch.no_grad():
        tower = model.tower(x, grids)
        merged = model.merge(tower, grids)
        out = model(x, grids)
    assert out.dtype == dtype and out.shape == (sum(h * w // 4 for _, h, w in grids), model.cfg.text_hidden_size)
    tol = 2e-6 if dtype == torch.float32 else 2e-2
    for name, got in (("tower", tower), ("merged", merged), ("out", out)):
        assert _rel(got, want[name]) < tol, name


def test_packed_images_do_not_attend_to_each_other(models):
    model = models[torch.float32]
    x = _patches(TWO, seed=1)
    with torch.no_grad():
        packed = model(x, TWO)
        alone = [model(x[:24], TWO[:1]), model(x[24:], TWO[1:])]
        y = x.clone()
        y[24:] = -y[24:]
        other = model(y, TWO)
    torch.testing.assert_close(packed, torch.cat(alone), rtol=1e-5, atol=1e-6)
    assert torch.equal(other[:6], packed[:6])  # image 0's rows ignore image 1 exactly
    assert not torch.allclose(other[6:], packed[6:])


def test_rope2d_is_column_first():
    """At (row 0, col 1), head dim 4: pair 0 turns by col * theta^0 = 1 rad, pair 1 stays."""
    rows, cols = torch.tensor([0]), torch.tensor([1])
    x = torch.ones(1, 1, 4, dtype=torch.float64)
    c, s = math.cos(1.0), math.sin(1.0)
    want = torch.tensor([[[c - s, s + c, 1.0, 1.0]]], dtype=torch.float64)
    cos, sin = vops.rope2d_cos_sin(rows, cols, 4, dtype=torch.float64)
    torch.testing.assert_close(vops.apply_rope2d(x, cos, sin), want)
    torch.testing.assert_close(ref.naive_rope2d(x, rows, cols), want)


def test_rope2d_matches_reference_and_swapping_row_col_changes_it():
    rows, cols = vops.grid_positions([(2, 3), (3, 2)])
    x = torch.randn(12, 2, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    got = vops.apply_rope2d(x, *vops.rope2d_cos_sin(rows, cols, 16, dtype=torch.float64))
    torch.testing.assert_close(got, ref.naive_rope2d(x, rows, cols))
    swapped = vops.apply_rope2d(x, *vops.rope2d_cos_sin(cols, rows, 16, dtype=torch.float64))
    assert (swapped - got).abs().max() > 0.1


def test_tower_notices_row_col_swap(models, weights64, monkeypatch):
    """The reference run row-first disagrees with the model on a non-square image."""
    model, x = models[torch.float32], _patches(ONE)
    with torch.no_grad():
        got = model.tower(x, ONE).double()
    rows_cols = ref.naive_grid_rows_cols
    monkeypatch.setattr(ref, "naive_grid_rows_cols", lambda h, w: rows_cols(h, w)[::-1])
    row_first = ref.naive_tower_image(weights64, x.double(), 4, 6, model.cfg.num_heads, FP32_EPS)
    assert _rel(got, row_first) > 1e-3


def test_merge_window_order_row_major():
    x = torch.arange(16.0)[:, None]  # patch i holds the value i, 4x4 grid row-major
    want = torch.tensor([[0, 1, 4, 5], [2, 3, 6, 7], [8, 9, 12, 13], [10, 11, 14, 15]], dtype=torch.float32)
    assert torch.equal(vops.sd2_tpool(x, [(1, 4, 4)]), want)
    assert torch.equal(ref.naive_merge(x, [(1, 4, 4)]), want)
    two = torch.cat([x, 100 + torch.arange(8.0)[:, None]])  # + a 2x4 image
    got = vops.sd2_tpool(two, [(1, 4, 4), (1, 2, 4)])
    assert torch.equal(got[4:], torch.tensor([[100, 101, 104, 105], [102, 103, 106, 107]], dtype=torch.float32))
    frames = torch.cat([x, x + 16])  # t = 2: windows averaged over time
    assert torch.equal(vops.sd2_tpool(frames, [(2, 4, 4)]), want + 8)


@pytest.mark.parametrize("hw", [(4, 4), (6, 2), (3, 7), (8, 8), (2, 2)], ids=str)
def test_pos_emb_bilinear_matches_formula(hw):
    table = torch.randn(4, 4, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    torch.testing.assert_close(vops.interp_pos_emb(table, *hw), ref.naive_bilinear(table, *hw))


def _dense_mask_attention(q, k, v, lengths):
    """The old packed path: one SDPA call over all images with a block-diagonal [L, L] mask."""
    seg = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    mask = seg[:, None] == seg[None, :]
    q, k, v = (t.transpose(0, 1) for t in (q, k, v))
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(0, 1)


@pytest.mark.parametrize("max_bytes", [1, 4 * 6 * 3 * 2, vops.SCORE_BYTES], ids=["row", "2rows", "whole"])
def test_per_image_attention_matches_dense_mask_and_oracle(max_bytes):
    """Each image attends only to itself, in query chunks of `query_chunk` rows (one row, two, or
    the whole image): equal to the dense-mask computation and to the per-image naive oracle."""
    g = torch.Generator().manual_seed(4)
    lengths = [4, 6, 5]
    q, k, v = (torch.randn(sum(lengths), 3, 8, dtype=torch.float64, generator=g) for _ in range(3))
    got = vops.packed_attention(q, k, v, lengths, max_bytes)
    torch.testing.assert_close(got, _dense_mask_attention(q, k, v, lengths))
    bounds = [0, 4, 10, 15]
    want = torch.cat([ref.naive_attention(q[a:b], k[a:b], v[a:b]) for a, b in zip(bounds, bounds[1:])])
    torch.testing.assert_close(got, want)
    assert vops.query_chunk(6, 3, max_bytes) == {1: 1, 144: 2}.get(max_bytes, 466033)


def test_no_attention_call_sees_more_than_the_score_bound(monkeypatch):
    """The tower's attention never forms a cross-image or over-bound score matrix: every SDPA call
    gets no mask and at most `query_chunk` query rows of one image's keys."""
    calls = []
    real = torch.nn.functional.scaled_dot_product_attention

    def spy(q, k, v, attn_mask=None, **kw):
        calls.append((q.shape[-2], k.shape[-2], attn_mask))
        return real(q, k, v, attn_mask=attn_mask, **kw)

    monkeypatch.setattr(vops.F, "scaled_dot_product_attention", spy)
    q = torch.randn(16 + 12, 2, 4)
    vops.packed_attention(q, q, q, [16, 12], 4 * 2 * 16 * 5)  # 5 rows of 16 keys, 6 of 12
    assert all(m is None for *_, m in calls)
    assert {(rows, keys) for rows, keys, _ in calls} == {(5, 16), (1, 16), (6, 12)}


def test_norm_eps_is_what_pytorch_uses_when_unset():
    """OQ-5: `nn.RMSNorm` with eps unset uses the compute type's eps, fp32's for bf16 input (not
    2^-7, which changes small-magnitude rows); a pinned eps wins."""
    norm = VisionRMSNorm(8, None)
    x = torch.randn(3, 8) * 1e-3
    for dtype in (torch.bfloat16, torch.float32):
        w = norm.weight.to(dtype)
        torch_default = torch.nn.functional.rms_norm(x.to(dtype), (8,), w)
        assert torch.equal(norm.to(dtype)(x.to(dtype)), rms_norm(x.to(dtype), w, FP32_EPS))
        assert torch.allclose(norm(x.to(dtype)).float(), torch_default.float(), atol=1e-2)
    xb, wb = x.bfloat16(), norm.weight.bfloat16()
    bf16_default = torch.nn.functional.rms_norm(xb, (8,), wb)
    assert (rms_norm(xb, wb, 2.0**-7).float() - bf16_default.float()).abs().max() > 0.5
    pinned = VisionRMSNorm(8, 2.0**-7)
    assert torch.equal(pinned(x), rms_norm(x, pinned.weight, 2.0**-7))


def test_linears_and_norms_go_through_the_ops_seam(models):
    class Counting(TorchOps):
        def __init__(self):
            self.calls = Counter()

        def linear(self, x, w):
            self.calls["linear"] += 1
            return super().linear(x, w)

        def rms_norm(self, x, w, eps, prepared=None):
            self.calls["rms_norm"] += 1
            return super().rms_norm(x, w, eps, prepared)

    model, ops = models[torch.float32], Counting()
    bound = [m for m in model.modules() if isinstance(m, OpsModule)]
    for m in bound:
        m.ops = ops
    try:
        with torch.no_grad():
            model(_patches(ONE), ONE)
    finally:
        for m in bound:
            del m.ops
    n = model.cfg.num_layers
    assert ops.calls == {"linear": 1 + 4 * n + 2, "rms_norm": 2 * n + 2}


def test_attention_goes_through_the_ops_seam(models):
    class Counting(TorchOps):
        calls = 0

        def vision_attention(self, q, k, v, mask):
            Counting.calls += 1
            return super().vision_attention(q, k, v, mask)

    model = models[torch.float32]
    with torch.no_grad():
        want = model(_patches(TWO), TWO)
    bound = [m for m in model.modules() if isinstance(m, OpsModule)]
    for m in bound:
        m.ops = Counting()
    try:
        with torch.no_grad():
            got = model(_patches(TWO), TWO)
    finally:
        for m in bound:
            del m.ops
    assert Counting.calls == model.cfg.num_layers and torch.equal(got, want)


def test_bad_grids_are_rejected(models):
    model = models[torch.float32]
    with pytest.raises(ValueError, match="t = 1"):
        model(_patches([(2, 2, 2)]), [(2, 2, 2)])
    with pytest.raises(ValueError, match="multiples"):
        model(_patches([(1, 3, 2)]), [(1, 3, 2)])
    with pytest.raises(ValueError, match="patches for grids"):
        model(_patches(ONE), [(1, 2, 2)])


def test_checkpoint_problems_are_listed(ckpt, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(ckpt, bad)
    index_path = bad / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    wo, gone = "vision_tower.encoder.blocks.0.wo.weight", "mm_projector.post_norm.weight"
    for fname in set(index["weight_map"].values()):
        tensors = load_file(bad / fname)
        if wo in tensors:
            tensors[wo] = torch.zeros(tensors[wo].shape[0], tensors[wo].shape[1] + 1, dtype=tensors[wo].dtype)
            tensors["vision_tower.extra.weight"] = torch.zeros(2)
            index["weight_map"]["vision_tower.extra.weight"] = fname
        tensors.pop(gone, None)
        save_file(tensors, bad / fname, metadata={"format": "pt"})
    del index["weight_map"][gone]
    index_path.write_text(json.dumps(index))
    with pytest.raises(CheckpointError) as err:
        load_vision_model(bad, torch.float32)
    msg = str(err.value)
    assert f"mis-shaped tensors (1): {wo}: (32, 49) != expected (32, 48)" in msg
    assert f"missing tensors (1): {gone}" in msg
    assert "unexpected tensors (1): vision_tower.extra.weight" in msg
