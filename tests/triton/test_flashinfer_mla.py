"""The FlashInfer MLA decode adapter (`kernels.extern.flashinfer_mla`) against the reference
`mla_absorbed_attention`.

Without a GPU a FAKE `flashinfer.mla` (put in `sys.modules`) stands in: its wrapper enforces the
contract read in FlashInfer 0.7.4's source (keyword-only calls; CSR metadata int32, rank 1,
contiguous, on the host, kv_indptr = the cumulated ceil(kv_len / page_size), kv_indices exactly
kv_indptr[-1] long; query / KV shapes, dtypes and the FA kernels' 16-byte stride rules) and
computes the attention in plain torch from exactly the paged arguments it was given. Both call
forms are covered: `MLAPlanMetadata` + packed `query=` / `kv_cache=` (FlashInfer >= 0.7) and flat
CSR + split tensors (older releases). The step's index tensors live on the `meta` device with host
copies attached (as `kernels.transfer.to_device` leaves them), so any read-back of them fails.
Where the real flashinfer imports and CUDA is present, the real kernel is compared too."""

import dataclasses
import sys
import types

import pytest
import torch

from deltaserve.cache.forward_batch import MlaRowsView
from deltaserve.kernels.extern import flashinfer_mla as FI
from deltaserve.kernels.transfer import host_copy, to_device
from deltaserve.ops.mla import mla_absorbed_attention

pytestmark = pytest.mark.triton
R, DR, PAGE = 512, 64, 8
META = ("qo_indptr", "kv_indptr", "kv_indices", "kv_len_arr")
PLAN = {"num_heads", "head_dim_ckv", "head_dim_kpe", "page_size", "causal", "sm_scale", "q_data_type", "kv_data_type"}
HALF = (torch.bfloat16, torch.float16)


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _close(got, ref, rtol=1e-2):
    got, ref = got.cpu().double(), ref.cpu().double()
    torch.testing.assert_close(got, ref, rtol=rtol, atol=rtol * float(ref.abs().max()))


class _Step:
    """Stands in for the step's ForwardBatch (only its identity matters)."""


# ---------------------------------------------------------------- the fake flashinfer


@dataclasses.dataclass(frozen=True)
class _PlanMetadata:
    qo_indptr: torch.Tensor
    kv_indptr: torch.Tensor
    kv_indices: torch.Tensor
    kv_len_arr: torch.Tensor

    @classmethod
    def csr(cls, qo_indptr, kv_indptr, kv_indices, kv_len_arr):
        return cls(qo_indptr, kv_indptr, kv_indices, kv_len_arr)


def _fa_layout(t: torch.Tensor, device, name: str):
    """The FA kernels read outer strides and load 16-byte vectors (`_prepare_planned_inputs`)."""
    assert t.dim() == 3 and t.stride(-1) == 1 and t.device == device, name
    assert t.data_ptr() % 16 == 0 and all(t.stride(a) * t.element_size() % 16 == 0 for a in (0, 1)), name


def _fake_flashinfer(structural: bool, calls: dict):
    class Wrapper:
        def __init__(self, float_workspace_buffer, use_cuda_graph=False, backend="auto", **bufs):
            assert float_workspace_buffer.dtype in (torch.uint8, torch.int8) and float_workspace_buffer.dim() == 1
            assert float_workspace_buffer.numel() >= 64 << 20 and not use_cuda_graph and not bufs
            assert backend in ("auto", "fa2", "fa3")
            self.device, self.planned = float_workspace_buffer.device, None
            calls["init"].append(self)

        def plan(self, *args, **kw):
            assert not args, "positional plan arguments are deprecated"
            if structural:
                meta = kw.pop("metadata")
                assert isinstance(meta, _PlanMetadata) and not set(META) & set(kw)
                meta = dataclasses.asdict(meta)
            else:
                assert "metadata" not in kw
                meta = {k: kw.pop(k) for k in META}
            assert set(kw) == PLAN, set(kw) ^ PLAN
            for name, t in meta.items():
                assert isinstance(t, torch.Tensor) and t.dtype == torch.int32 and t.dim() == 1, name
                assert t.device.type == "cpu" and t.is_contiguous(), f"{name}: host tensor expected"
            qo, kvp, kvi, lens = (meta[k].tolist() for k in META)
            ps = kw["page_size"]
            assert isinstance(ps, int) and ps >= 1 and isinstance(kw["num_heads"], int)
            assert isinstance(kw["causal"], bool) and isinstance(kw["sm_scale"], float)
            assert qo[0] == 0 and all(a <= b for a, b in zip(qo, qo[1:])) and len(lens) == len(qo) - 1
            assert len(kvp) == len(qo) and kvp[0] == 0 and all(n >= 1 for n in lens)
            assert [b - a for a, b in zip(kvp, kvp[1:])] == [-(-n // ps) for n in lens], "kv_indptr != ceil pages"
            assert kvp[-1] == len(kvi) and min(kvi) >= 0
            assert kw["q_data_type"] in HALF and kw["kv_data_type"] == kw["q_data_type"]
            assert kw["head_dim_ckv"] % 128 == 0 and kw["head_dim_kpe"] % 64 == 0
            self.planned = dict(kw, qo=qo, kvp=kvp, kvi=kvi, lens=lens)
            calls["plan"].append(self.planned)

        def run(self, *args, **kw):
            assert not args and self.planned is not None
            p = self.planned
            wq, wk = p["head_dim_ckv"], p["head_dim_kpe"]
            if structural:
                assert set(kw) == {"query", "kv_cache"}
                q, kv = kw["query"], kw["kv_cache"]
                assert q.dim() == 3 and kv.dim() == 3 and q.shape[-1] == kv.shape[-1] == wq + wk
                q_nope, q_pe, ckv, kpe = q[..., :wq], q[..., wq:], kv[..., :wq], kv[..., wq:]
            else:
                assert set(kw) == {"q_nope", "q_pe", "ckv_cache", "kpe_cache"}
                q_nope, q_pe, ckv, kpe = (kw[k] for k in ("q_nope", "q_pe", "ckv_cache", "kpe_cache"))
            for name, t in dict(q_nope=q_nope, q_pe=q_pe, ckv=ckv, kpe=kpe).items():
                _fa_layout(t, self.device, name)
            assert q_nope.dtype == q_pe.dtype == p["q_data_type"] and ckv.dtype == kpe.dtype == p["kv_data_type"]
            assert q_nope.shape == (p["qo"][-1], p["num_heads"], wq) and q_pe.shape == q_nope.shape[:2] + (wk,)
            assert ckv.shape[1:] == (p["page_size"], wq) and kpe.shape == ckv.shape[:2] + (wk,)
            assert max(p["kvi"]) < ckv.shape[0], "page index outside the cache"
            calls["run"].append(kw)
            out = torch.empty(q_nope.shape, dtype=q_nope.dtype, device=q_nope.device)
            for b, n_kv in enumerate(p["lens"]):
                pages = torch.tensor(p["kvi"][p["kvp"][b] : p["kvp"][b + 1]])
                t = torch.arange(n_kv)
                page, off = pages[t // p["page_size"]], t % p["page_size"]
                kn, kp = ckv[page, off].float(), kpe[page, off].float()
                qs = slice(p["qo"][b], p["qo"][b + 1])
                s = torch.einsum("nhr,lr->nhl", q_nope[qs].float(), kn) + torch.einsum(
                    "nhr,lr->nhl", q_pe[qs].float(), kp
                )
                if p["causal"]:
                    n_q = qs.stop - qs.start
                    s = s.masked_fill(t[None, None, :] > (n_kv - n_q + torch.arange(n_q))[:, None, None], float("-inf"))
                out[qs] = torch.einsum("nhl,lr->nhr", torch.softmax(s * p["sm_scale"], -1), kn).to(out.dtype)
            return out

    pkg, mla = types.ModuleType("flashinfer"), types.ModuleType("flashinfer.mla")
    pkg.__path__, pkg.mla, mla.BatchMLAPagedAttentionWrapper = [], mla, Wrapper
    if structural:
        mla.MLAPlanMetadata = _PlanMetadata
    return pkg, mla


def _reset():
    FI._mla.cache_clear()
    FI._device.cache_clear()
    FI._refused_plan.cache_clear()


@pytest.fixture(params=[True, False], ids=["metadata-packed", "flat-split"])
def fake(request, monkeypatch):
    calls = {"init": [], "plan": [], "run": []}
    pkg, mla = _fake_flashinfer(request.param, calls)
    monkeypatch.setitem(sys.modules, "flashinfer", pkg)
    monkeypatch.setitem(sys.modules, "flashinfer.mla", mla)
    monkeypatch.delenv("DELTASERVE_FLASHINFER", raising=False)
    _reset()
    yield calls
    _reset()


# ---------------------------------------------------------------- a random paged step


def _case(seed, lens, heads=4, page=PAGE, num_pages=16, dtype=torch.bfloat16, device="cpu", index_device="meta"):
    """(q_latent, rows, view, scale, reference output): `lens` contexts on permuted pages of a pool whose
    other pages hold large garbage (reading one shows); index tensors on `index_device`."""
    g = _gen(seed)
    need = [-(-n // page) for n in lens]
    perm = torch.randperm(num_pages, generator=g)[: sum(need)].tolist()
    table = torch.zeros(len(lens), max(need), dtype=torch.long)
    for b, k in enumerate(need):
        table[b, :k] = torch.tensor(perm[sum(need[:b]) : sum(need[: b + 1])])
    rows = torch.full((num_pages * page, R + DR), 40.0)
    read = torch.cat([table[b, torch.arange(n) // page] * page + torch.arange(n) % page for b, n in enumerate(lens)])
    rows[read] = torch.randn(len(read), R + DR, generator=g)
    rows = rows.to(dtype=dtype, device=device)
    q = (torch.randn(len(lens), heads, R + DR, generator=g) * 0.2).to(dtype=dtype, device=device)
    cu_kv = torch.tensor([0, *lens]).cumsum(0)
    idx = to_device({"cu_kv": cu_kv, "table": table}, index_device)
    scale = (R + DR) ** -0.5
    ref = mla_absorbed_attention(q, rows[read.to(device)], torch.arange(len(lens) + 1), cu_kv, R, scale)
    view = MlaRowsView(rows=rows, cu_kv=idx["cu_kv"], block_table=idx["table"], page_size=page, batch=_Step())
    return q, rows, view, scale, ref


LENS = [1, 7, 16, 23, 9]


# ---------------------------------------------------------------- tests with the fake


def _read(view, rows):
    """(rows of every context position, cu_q, cu_kv) for the reference, from the view's host copies."""
    table, cu = host_copy(view.block_table), host_copy(view.cu_kv)
    lens, p = (cu[1:] - cu[:-1]).tolist(), view.page_size
    read = torch.cat([table[b, torch.arange(n) // p] * p + torch.arange(n) % p for b, n in enumerate(lens)])
    return rows[read], torch.arange(len(lens) + 1), cu


def test_decode_matches_reference_and_plans_once_per_step(fake):
    q, rows, view, scale, ref = _case(0, LENS)
    meta = FI._plan_args(view)
    assert meta["qo_indptr"].tolist() == list(range(len(LENS) + 1))
    assert meta["kv_len_arr"].tolist() == LENS
    assert meta["kv_indptr"].tolist() == [0, 1, 2, 4, 7, 9]
    _close(FI.decode(q, view, R, scale), ref)
    # another layer of the same step: its own pool rows and query, the same plan
    g = _gen(1)
    q2, rows2 = torch.randn(q.shape, generator=g).to(q.dtype) * 0.2, torch.randn(rows.shape, generator=g).to(rows.dtype)
    _close(
        FI.decode(q2, dataclasses.replace(view, rows=rows2), R, scale),
        mla_absorbed_attention(q2, *_read(view, rows2), R, scale),
    )
    assert len(fake["plan"]) == 1 and len(fake["run"]) == 2 and len(fake["init"]) == 1
    # a new step replans (same wrapper and workspace)
    q3, _, view3, _, ref3 = _case(3, [30, 2, 5])
    _close(FI.decode(q3, view3, R, scale), ref3)
    assert len(fake["plan"]) == 2 and len(fake["init"]) == 1
    # so does the same step at another dtype
    _close(FI.decode(q3.half(), dataclasses.replace(view3, rows=view3.rows.half()), R, scale), ref3)
    assert len(fake["plan"]) == 3


def test_a_refused_plan_falls_back_once_per_step(fake, monkeypatch, caplog):
    """FlashInfer's planner refusing a step (ValueError) gives None for every layer of that step,
    asked once and logged; the next step plans again."""
    q, _, view, scale, ref = _case(5, LENS)
    wrapper_type = type(FI._device(q.device).wrapper)
    real_plan = wrapper_type.plan

    def refusing(self, *args, **kw):
        fake["plan"].append("refused")
        raise ValueError("too many work items")

    monkeypatch.setattr(wrapper_type, "plan", refusing)
    assert FI.decode(q, view, R, scale) is None and FI.decode(q, view, R, scale) is None
    assert fake["plan"] == ["refused"] and not fake["run"]
    assert "too many work items" in caplog.text
    monkeypatch.setattr(wrapper_type, "plan", real_plan)
    q3, _, view3, _, ref3 = _case(6, [30, 2, 5])
    _close(FI.decode(q3, view3, R, scale), ref3)


def test_decode_passes_the_pool_without_copies(fake):
    q, rows, view, scale, _ = _case(4, LENS)
    FI.decode(q, view, R, scale)
    kw = fake["run"][-1]
    cache = kw.get("kv_cache", kw.get("ckv_cache"))
    assert (
        cache.data_ptr() == rows.data_ptr() and cache.untyped_storage().data_ptr() == rows.untyped_storage().data_ptr()
    )
    if "kpe_cache" in kw:
        assert kw["kpe_cache"].data_ptr() == rows.data_ptr() + R * rows.element_size()


@pytest.mark.parametrize("page", [1, 3, 16])
def test_decode_page_sizes(fake, page):
    q, _, view, scale, ref = _case(5, [1, 2, 17, 33], page=page, num_pages=80 // page + 4)
    _close(FI.decode(q, view, R, scale), ref)


@pytest.mark.parametrize("wrong", ["len", "indices", "indptr"])
def test_fake_catches_wrong_metadata(fake, wrong):
    """The fake is strict: metadata off by one length, two swapped pages or a bad indptr fails."""
    q, rows, view, scale, ref = _case(6, LENS)
    meta = FI._plan_args(view)
    if wrong == "len":
        meta["kv_len_arr"][3] -= 1  # 23 -> 22: same page count, one row fewer
    elif wrong == "indices":
        meta["kv_indices"][[1, 2]] = meta["kv_indices"][[2, 1]]  # across sequences 1 and 2
    else:
        meta["kv_indptr"][2] += 1
    wrapper = FI._device(q.device).wrapper
    try:
        FI._plan(wrapper, meta, q.shape[1], R, DR, PAGE, scale, q.dtype)
        got = FI._run(wrapper, q, rows.view(-1, PAGE, R + DR), R)
    except AssertionError:
        return
    with pytest.raises(AssertionError):
        _close(got, ref)


def test_available_and_fits(fake, monkeypatch):
    assert FI.available()
    q, rows, *_ = _case(7, [3])
    assert FI._refusal(q, rows, R, PAGE) is None
    assert not FI.fits(q, rows, R, PAGE)  # CPU tensors
    assert FI._refusal(q.float(), rows.float(), R, PAGE)  # fp32 keeps our exact kernel
    assert FI._refusal(q, rows.half(), R, PAGE)  # mixed dtypes
    assert FI._refusal(q[..., 64:], rows[:, 64:].contiguous(), R - 64, PAGE)  # kv_lora_rank 448
    assert FI._refusal(q, rows, R - 64, PAGE)  # rope width 128
    assert FI._refusal(q, rows[:-1], R, PAGE)  # not whole pages
    wide = torch.zeros(rows.shape[0], 2 * (R + DR), dtype=rows.dtype)[:, : R + DR]
    assert FI._refusal(q, wide, R, PAGE)  # strided pool
    monkeypatch.setenv("DELTASERVE_FLASHINFER", "0")
    _reset()
    assert not FI.available()


def test_unavailable_without_the_wrapper(monkeypatch):
    monkeypatch.setitem(sys.modules, "flashinfer", types.ModuleType("flashinfer"))
    monkeypatch.setitem(sys.modules, "flashinfer.mla", types.ModuleType("flashinfer.mla"))
    _reset()
    try:
        assert not FI.available()
    finally:
        _reset()


# ---------------------------------------------------------------- the real kernel


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA and flashinfer")
@pytest.mark.parametrize("page", [1, 16, 64])
def test_real_flashinfer_matches_reference(page):
    _reset()
    if not FI.available():
        pytest.skip("flashinfer.mla does not import")
    lens = [1, 5, 64, 300, 1000, 17]
    pages = 1500 // page + 8
    q, rows, view, scale, ref = _case(8, lens, heads=16, page=page, num_pages=pages, device="cuda", index_device="cuda")
    assert FI.fits(q, rows, R, page)
    got = FI.decode(q, view, R, scale)
    assert got.shape == (len(lens), 16, R) and got.dtype == q.dtype
    _close(got, ref, rtol=2e-2)
    _close(FI.decode(q, view, R, scale), ref, rtol=2e-2)  # planned once, run again
