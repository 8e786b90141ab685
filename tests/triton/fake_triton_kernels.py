"""A FAKE `triton_kernels` (the triton v3.5 API generation vLLM vendors) for `test_ogs_moe.py`: it
enforces the contract read in that source and computes in plain torch what the kernels compute from
exactly the arguments they receive (see the test module's docstring)."""

import dataclasses
import types

import torch
import triton
import triton.language as tl

E2M1 = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6])


@triton.jit
def _apply_kernel(X, Y, M, N, A0, A1, FN: tl.constexpr, NARGS: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):
    """Y[m, :N/2] = FN(X[m, :N]) over one BM x BN tile (what the matmul epilogue does to its acc)."""
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    cols, half = tl.arange(0, BN), tl.arange(0, BN // 2)
    x = tl.load(X + rows[:, None] * N + cols[None, :], mask=(rows[:, None] < M) & (cols[None, :] < N), other=0.0)
    if NARGS == 0:
        y = FN(x)
    else:
        y = FN(x, A0, A1)
    tl.store(Y + rows[:, None] * (N // 2) + half[None, :], y, mask=(rows[:, None] < M) & (half[None, :] < N // 2))


def run_fn(specs, args, acc):
    m, n = acc.shape
    assert len(args) == len(specs.fn_arg_names) in (0, 2), "fn_args must match fn_arg_names"
    out = torch.empty(m, n // 2, dtype=torch.float32, device=acc.device)
    bn = triton.next_power_of_2(n)
    _apply_kernel[(triton.cdiv(m, 16),)](
        acc.contiguous(), out, m, n, *(args or (0.0, 0.0)), specs.fn, len(args), 16, bn
    )
    return out


def _decode_w(w, scale):
    """The kernel's reading of an FP4 [E, K, N] (storage [E, K/2, N], codes along K) and scales."""
    data = w.storage.data
    codes = torch.stack([data & 0xF, data >> 4], dim=2).flatten(1, 2).long()  # k = 2i: low nibble
    vals = E2M1.to(data.device)[codes]
    return vals * torch.exp2(scale.storage.data.double() - 127).float().repeat_interleave(32, dim=1)


def fake_library(calls: dict):
    mods = {n: types.ModuleType(n) for n in ("", ".matmul_ogs", ".routing", ".tensor", ".tensor_details")}
    mods.update({n: types.ModuleType(n) for n in (".tensor_details.layout", ".matmul_ogs_details")})
    mods[".matmul_ogs_details.opt_flags"] = types.ModuleType("opt_flags")
    tk, mm, rt, ts, lay = (mods[n] for n in ("", ".matmul_ogs", ".routing", ".tensor", ".tensor_details.layout"))

    @dataclasses.dataclass
    class FloatType:
        bitwidth_exponent: int
        bitwidth_mantissa: int
        is_signed: bool

    class StridedLayout:
        name = None

        def __init__(self, shape):
            self.initial_shape = shape

    @dataclasses.dataclass
    class Storage:
        data: torch.Tensor
        layout: object = None

    @dataclasses.dataclass
    class Tensor:
        storage: Storage
        dtype: object = None
        shape: list = None

    fp4 = FloatType(2, 1, True)

    def wrap_torch_tensor(t, dtype=None):
        dtype = t.dtype if dtype is None else dtype
        shape = list(t.shape)
        shape[t.stride().index(1)] *= 2 if dtype is fp4 else 1
        return Tensor(Storage(t, StridedLayout(t.shape)), dtype, shape)

    def convert_layout(tensor, layout_cls, **kw):
        assert isinstance(tensor, Tensor) and layout_cls is StridedLayout and not kw
        return Tensor(Storage(tensor.storage.data, layout_cls(tensor.storage.data.shape)), tensor.dtype, tensor.shape)

    @dataclasses.dataclass
    class ExptData:
        hist: torch.Tensor
        token_offs_raw: torch.Tensor
        token_offs_pad: dict
        block_pid_map: dict

    @dataclasses.dataclass
    class RoutingData:
        gate_scal: torch.Tensor
        expt_hist: torch.Tensor
        n_expts_tot: int
        n_expts_act: int
        expt_data: ExptData = None
        expected_tokens_per_expt: int = None

    @dataclasses.dataclass
    class GatherIndx:
        src_indx: torch.Tensor
        dst_indx: torch.Tensor

    @dataclasses.dataclass
    class ScatterIndx:
        src_indx: torch.Tensor
        dst_indx: torch.Tensor

    def compute_expt_data(expt_hist, n_expts_tot, n_gates):
        assert expt_hist.dtype == torch.int32 and expt_hist.shape == (n_expts_tot,) and isinstance(n_gates, int)
        offs = torch.cat([expt_hist.new_zeros(1), expt_hist.cumsum(0)]).int()
        pad = {b: torch.cat([offs[:1], ((expt_hist + b - 1) // b).cumsum(0)]).int() for b in (16, 32, 64, 128)}
        calls["expt_data"].append(n_gates)
        return ExptData(expt_hist, offs, pad, {})

    @dataclasses.dataclass(frozen=True)
    class FnSpecs:
        name: str
        fn: object
        fn_arg_names: tuple
        fn_arg_do_not_specialize: tuple = ()

    @dataclasses.dataclass(frozen=True)
    class FusedActivation:
        specs: FnSpecs = None
        fn_args: tuple = ()
        reduction_n: int = 1

    @dataclasses.dataclass
    class PrecisionConfig:
        weight_scale: object = None
        act_scale: object = None
        out_scale: object = None
        out_dtype: torch.dtype = None

    def _indices(ix, m):
        assert ix.src_indx.dtype == ix.dst_indx.dtype == torch.int32 and ix.src_indx.shape == (m,)
        assert torch.equal(ix.dst_indx[ix.src_indx.long()].cpu(), torch.arange(m, dtype=torch.int32)), "dst[src] != id"
        return ix.src_indx.long(), ix.dst_indx.long()

    def matmul_ogs(x, w, bias, routing_data=None, gather_indx=None, scatter_indx=None, precision_config=None, **kw):
        gammas, fused = kw.pop("gammas", None), kw.pop("fused_activation", None)
        assert set(kw) <= {"betas", "out_alpha", "y", "epilogue"}, f"not matmul_ogs arguments: {set(kw)}"
        assert bias is None and not any(v is not None for v in kw.values()), "no bias / betas / y / epilogue"
        assert isinstance(x, torch.Tensor) and x.dtype == torch.bfloat16 and x.dim() == 2 and x.stride(-1) == 1
        assert isinstance(w, Tensor) and w.dtype is fp4 and isinstance(w.storage.layout, StridedLayout)
        data, scale = w.storage.data, precision_config.weight_scale
        assert data.dtype == torch.uint8 and data.dim() == 3 and data.stride(-2) == 1, "W_TRANSPOSE: codes along K"
        num, k_dim, n_dim = w.shape
        assert (k_dim, n_dim) == (2 * data.shape[1], data.shape[2]) and k_dim == x.shape[1]
        assert isinstance(scale, Tensor) and scale.storage.data.dtype == torch.uint8
        assert tuple(scale.storage.data.shape) == (num, k_dim // 32, n_dim)
        assert precision_config.act_scale is None and precision_config.out_scale is None
        rd = routing_data
        assert isinstance(rd, RoutingData) and rd.n_expts_tot == num and isinstance(rd.expt_data, ExptData)
        hist, offs = rd.expt_data.hist, rd.expt_data.token_offs_raw
        assert hist.dtype == offs.dtype == torch.int32 and hist.shape == (num,)
        assert torch.equal(offs.cpu(), torch.cat([hist.new_zeros(1), hist.cumsum(0)]).cpu()), "token_offs_raw"
        assert (gather_indx is None) != (scatter_indx is None), "one of gather / scatter per call here"
        m = gather_indx.src_indx.shape[0] if gather_indx is not None else x.shape[0]
        rows = _indices(gather_indx, m)[0] // rd.n_expts_act if gather_indx is not None else torch.arange(m)
        wd = _decode_w(w, scale)
        acc = torch.zeros(m, n_dim, dtype=torch.float32, device=x.device)
        for e, (lo, count) in enumerate(zip(offs.tolist(), hist.tolist())):
            acc[lo : lo + count] = x[rows[lo : lo + count]].float() @ wd[e]
        if fused is not None:
            assert isinstance(fused, FusedActivation) and fused.reduction_n == 2 and n_dim % 2 == 0
            acc = run_fn(fused.specs, fused.fn_args, acc)
        if gammas is not None:
            assert gammas.shape == (m,) and gammas.dtype in (torch.float32, torch.bfloat16)
            acc = acc * gammas.float()[:, None]
        y = acc.to(precision_config.out_dtype or x.dtype)
        calls["matmul"].append(dict(gather=gather_indx is not None, fused=fused, gammas=gammas, w=w))
        if scatter_indx is None:
            return y
        src, dst = _indices(scatter_indx, m)
        k = rd.n_expts_act
        if k == 1:  # the fused scatter: row r written to dst[r]
            return torch.zeros_like(y).index_copy_(0, dst, y)
        return y[src.view(-1, k)].float().sum(1).to(y.dtype)  # fp32 sum over the slots in order

    mm.__dict__.update(matmul_ogs=matmul_ogs, PrecisionConfig=PrecisionConfig, FusedActivation=FusedActivation)
    mm.__dict__.update(FnSpecs=FnSpecs, RoutingData=RoutingData, GatherIndx=GatherIndx, ScatterIndx=ScatterIndx)
    rt.__dict__.update(RoutingData=RoutingData, GatherIndx=GatherIndx, ScatterIndx=ScatterIndx, ExptData=ExptData)
    rt.compute_expt_data = compute_expt_data
    ts.__dict__.update(FP4=fp4, Tensor=Tensor, Storage=Storage, wrap_torch_tensor=wrap_torch_tensor)
    ts.convert_layout = convert_layout
    lay.StridedLayout = StridedLayout
    lay.make_default_matmul_mxfp4_w_layout = lambda mx_axis: (StridedLayout, {})
    lay.make_default_matmul_mxfp4_w_scale_layout = lambda mx_axis, num_warps=8: (StridedLayout, {})
    mods[".matmul_ogs_details.opt_flags"].update_opt_flags_constraints = calls["constraints"].update
    tk.__path__ = []
    return {f"triton_kernels{n}": mod for n, mod in mods.items()}
