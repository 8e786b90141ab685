"""ctypes bindings of the whole-stack decode kernel (`csrc/stack.c`): the stack's static part (each
layer's block plans, weights and norms) is described once in a `StackPlan`; each step passes the
embeddings, the pools' per-layer tensors and the step's slots and rows."""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ...parallel.context import Reduce
from .abi import MAX_MIX, STRUCTS
from .attention import kda_pool_fits
from .blocks import kda_record_fits, kda_record_width

StackStruct = STRUCTS["ds_stack_t"]
StackLayerStruct = STRUCTS["ds_stack_layer_t"]
KdaBlockPlan, MlaBlockPlan, MoeBlockPlan = (STRUCTS[n] for n in ("ds_kda_block_t", "ds_mla_block_t", "ds_moe_block_t"))


@dataclass
class StackLayerPlan:
    """One layer as the kernel reads it: a KDA or MLA block plan (MLA with its o_proj [D, H*v]) or an
    `Attend` the kernel calls back, a MoE block plan or the dense GLU (gate, up, down), its activation
    (kind, beta, linear beta), the AttnRes queries (fp32 [D] or None) and the two norms ((fp32 [D], eps))."""

    attn: object
    o_proj: torch.Tensor | None
    moe: object | None
    mlp: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None
    act: tuple[int, float, float]
    attn_q: torch.Tensor | None
    mlp_q: torch.Tensor | None
    attn_norm: tuple[torch.Tensor, float]
    mlp_norm: tuple[torch.Tensor, float]


class _Callback:
    """A C function pointer (`ctype`) over `fn`: returns 0, or 1 where `fn` raised, the exception kept
    (`error`) for the caller of the kernel."""

    def __init__(self, ctype, fn: Callable):
        self.fn = fn
        self.error: BaseException | None = None
        self.c_function = ctype(self._call)

    def _call(self, *args) -> int:
        try:
            self.fn(*args)
            return 0
        except BaseException as e:  # noqa: BLE001 - handed to the caller of the kernel
            self.error = e
            return 1


def _reduce_callback(reduce: Reduce) -> _Callback:
    """`ds_reduce_fn` over a `Reduce`: bf16 views of the kernel's buffers, the sum written back into the
    partial one."""

    def call(partial: int, replicated: int | None, n: int) -> None:
        p = _bf16_view(partial, n)
        out = reduce(p, None if replicated is None else _bf16_view(replicated, n))
        if out.data_ptr() != p.data_ptr():
            p.copy_(out)

    return _Callback(_REDUCE_FN, call)


Attend = Callable[[torch.Tensor], torch.Tensor]
"""A layer's attention as its module computes it: normed input [N, D] bf16 -> output [N, D] bf16, every
rank's share summed (decode context parallelism's MLA, whose collectives stay in Python)."""


def _attend_callback(layers: dict[int, Attend], d: int) -> _Callback:
    """`ds_attend_fn` over each callback layer's `Attend` (by layer index)."""

    def call(layer: int, x: int, rows: int, out: int) -> None:
        n = rows * d
        _bf16_view(out, n).copy_(layers[layer](_bf16_view(x, n).view(rows, d)).reshape(-1))

    return _Callback(_ATTEND_FN, call)


_REDUCE_FN = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64)
_ATTEND_FN = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p)


def _bf16_view(address: int, n: int) -> torch.Tensor:
    return torch.frombuffer((ctypes.c_uint16 * n).from_address(address), dtype=torch.bfloat16)


@dataclass
class StackPlan:
    """The filled `ds_stack_t` and everything its pointers reach (kept alive here), which layers are
    KDA (the rest MLA), and the most rows a step takes (the tile kernels' AMX_ROWS where they run
    every projection, else MAX_ROWS). `logits`: the plan holds the embeddings and the output head
    (`decode_logits` runs). `pools` memoises the last step's per-layer pool pointers.
    `kda_records`: (layer, block plan, record width) of each KDA layer, as `KdaRecord.take` takes them."""

    struct: object
    kda_layers: list[int]
    mla_layers: list[int]
    max_rows: int
    keep: list = field(default_factory=list)
    pools: tuple | None = None
    logits: bool = False
    kda_records: list = field(default_factory=list)


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _f32(t: torch.Tensor | None, d: int) -> bool:
    return t is None or (t.dtype == torch.float32 and t.is_contiguous() and t.numel() == d)


def _bf16(t: torch.Tensor | None, shape: tuple[int, ...]) -> bool:
    return t is not None and t.dtype == torch.bfloat16 and t.is_contiguous() and tuple(t.shape) == shape


class StackBindings:
    """Mixin of `NativeKernels` (`self.lib`: the library, its signatures declared from ds_abi.h)."""

    lib: ctypes.CDLL

    def stack_plan(
        self,
        d: int,
        layers: list[StackLayerPlan],
        block_size: int | None,
        res_eps: float,
        out_q: torch.Tensor | None,
        final_norm: tuple[torch.Tensor, float],
        head: tuple[torch.Tensor, torch.Tensor] | None = None,
        reduce: Reduce | None = None,
    ) -> StackPlan | None:
        """The plan of `ds_decode_stack`, or None where a layer does not fit it (the caller runs the
        layers one by one). `head`: the (embedding, lm_head) weights, bf16 [vocab, d] each, for
        `decode_logits` (left out where they do not fit). `reduce`: a tensor-parallel rank's sum over
        the ranks (`parallel.context.Reduce`), which the kernel calls back where the layers' outputs are partial."""
        if block_size is not None and -(-len(layers) // block_size) + 1 >= MAX_MIX:
            return None
        if not (_f32(out_q, d) and _f32(final_norm[0], d)) or (block_size is None) != (out_q is None):
            return None
        structs = (StackLayerStruct * len(layers))()
        keep: list = [structs, layers]
        kda_layers, mla_layers, attends = [], [], {}
        for i, (y, s) in enumerate(zip(layers, structs)):
            mla = isinstance(y.attn, MlaBlockPlan)
            if callable(y.attn):
                attends[i] = y.attn
            if not _layer_fits(y, d, block_size):
                return None
            if i not in attends:
                (mla_layers if mla else kda_layers).append(i)
                s.kda = None if mla else ctypes.pointer(y.attn)
                s.mla = ctypes.pointer(y.attn) if mla else None
            _fill_layer(s, y)
        struct = StackStruct(
            d,
            len(layers),
            block_size or 0,
            res_eps,
            final_norm[1],
            ctypes.cast(structs, ctypes.POINTER(StackLayerStruct)),
            _ptr(out_q),
            final_norm[0].data_ptr(),
        )
        keep += [out_q, final_norm]
        for field_name, callback in (
            ("reduce", None if reduce is None else _reduce_callback(reduce)),
            ("attend", _attend_callback(attends, d) if attends else None),
        ):
            if callback is not None:
                setattr(struct, field_name, ctypes.cast(callback.c_function, ctypes.c_void_p))
                keep.append(callback)
        logits = head is not None and all(_bf16(w, (head[1].shape[0], d)) for w in head)
        if logits:
            struct.vocab, struct.embed, struct.lm_head = head[1].shape[0], head[0].data_ptr(), head[1].data_ptr()
            keep.append(head)
        rows = min(self.multi_rows(k) for k in _widths(layers, d))
        kda = [(i, layers[i].attn, kda_record_width(layers[i].attn)) for i in kda_layers]
        return StackPlan(struct, kda_layers, mla_layers, rows, keep, logits=logits, kda_records=kda)

    def decode_stack(
        self, plan: StackPlan, x: torch.Tensor, kda_views: list, mla_views: list, records: list | None = None
    ) -> torch.Tensor | None:
        """The final-normed hidden states [N, D] of one decode step of the embeddings x [N <=
        plan.max_rows, D] bf16, or None where a router's limits do not hold or the tile kernels no
        longer run (nothing computed). `kda_views[i]` is KDA
        layer `plan.kda_layers[i]`'s (tails, states, slots) as `kda_block` takes them, `mla_views[i]`
        MLA layer `plan.mla_layers[i]`'s (rows, write_rows, read_rows, cu_kv) as `mla_block`; the
        slots and the row indices are the step's, shared by the layers. Updates the pools in place.
        `records[i]` (or None): KDA layer `plan.kda_layers[i]`'s record of the step's rows, as
        `kda_block` fills it."""
        n, d = x.shape
        if not (x.dtype == torch.bfloat16 and d == plan.struct.D and 0 < n <= plan.max_rows):
            raise ValueError("decode_stack: bad input")
        out = torch.empty(n, d, dtype=torch.bfloat16)
        return out if self._decode(plan, x.contiguous(), None, n, kda_views, mla_views, out, None, records) else None

    def decode_logits(
        self, plan: StackPlan, ids: torch.Tensor, kda_views: list, mla_views: list, records: list | None = None
    ) -> torch.Tensor | None:
        """fp32 logits [N, vocab] of one decode step of the token ids [N] (the values of
        `lm_head(decode_stack(embed(ids))).float()`: the embedding rows, the stack and the output head
        in the one call), or None as `decode_stack`. Needs `plan.logits`."""
        n = ids.numel()
        if not (plan.logits and ids.dim() == 1 and 0 < n <= plan.max_rows):
            raise ValueError("decode_logits: bad input")
        out = torch.empty(n, plan.struct.D, dtype=torch.bfloat16)
        logits = torch.empty(n, plan.struct.vocab, dtype=torch.float32)
        ids = ids.to(torch.int64).contiguous()
        return logits if self._decode(plan, None, ids, n, kda_views, mla_views, out, logits, records) else None

    def _decode(self, plan: StackPlan, x, ids, n: int, kda_views: list, mla_views: list, out, logits, records) -> bool:
        """One `ds_decode_stack` call; False where a router's limits or the tiles declined the step."""
        tails, states, rows, num_slots, num_rows = self._pools(plan, kda_views, mla_views)
        recorded = None if records is None else self._records(plan, n, records)
        slots = kda_views[0][2].contiguous() if kda_views else None
        _, write_rows, read_rows, cu_kv = mla_views[0] if mla_views else (None,) * 4
        if (slots is not None and slots.numel() != n) or (write_rows is not None and write_rows.numel() != n):
            raise ValueError("decode_stack: the step's slots or rows disagree with its tokens")
        rc = self.lib.ds_decode_stack(
            ctypes.byref(plan.struct),
            _ptr(x),
            _ptr(ids),
            n,
            tails,
            states,
            recorded,
            _ptr(slots),
            num_slots,
            rows,
            num_rows,
            *(_ptr(t if t is None else t.contiguous()) for t in (write_rows, read_rows, cu_kv)),
            out.data_ptr(),
            _ptr(logits),
            torch.get_num_threads(),
        )
        if rc in (-3, -4):  # a router's limits; more rows than the tiles take now (`set_tiles(False)`)
            return False
        if rc == -2:
            raise ValueError("decode_stack: token id, slot or row index out of range")
        if rc == -5:
            errors = (k.error for k in plan.keep if isinstance(k, _Callback))
            raise RuntimeError("decode_stack: a reduce or attend callback failed") from next(
                (e for e in errors if e is not None), None
            )
        if rc != 0:
            raise MemoryError(f"decode_stack: failed ({rc})")
        return True

    @staticmethod
    def _records(plan: StackPlan, n: int, records: list):
        """The per-layer pointer array of the KDA layers' records (NULL for the other layers)."""
        out = (ctypes.c_void_p * plan.struct.L)()
        if len(records) != len(plan.kda_layers):
            raise ValueError("decode_stack: one record per KDA layer is required")
        for i, r in zip(plan.kda_layers, records):
            b = plan.struct.layers[i].kda.contents
            if not kda_record_fits(r, n, b):
                raise ValueError("decode_stack: a KDA record disagrees with its layer")
            out[i] = r.data_ptr()
        return out

    def _pools(self, plan: StackPlan, kda_views: list, mla_views: list) -> tuple:
        """Per-layer pointer arrays of the pools (checked against the plan once per set of pools)."""
        layers = plan.struct.L
        key = tuple((t.data_ptr(), t.shape[0]) for v in kda_views for t in v[:2]) + tuple(
            (v[0].data_ptr(), v[0].shape[0]) for v in mla_views
        )
        if plan.pools is not None and plan.pools[0] == key:
            return plan.pools[1]
        if len(kda_views) != len(plan.kda_layers) or len(mla_views) != len(plan.mla_layers):
            raise ValueError("decode_stack: one pool view per layer is required")
        tails, states, rows = (ctypes.c_void_p * layers)(), (ctypes.c_void_p * layers)(), (ctypes.c_void_p * layers)()
        num_slots = {v[1].shape[0] for v in kda_views}
        num_rows = {v[0].shape[0] for v in mla_views}
        for i, (t, s, _) in zip(plan.kda_layers, kda_views):
            b = plan.struct.layers[i].kda.contents
            if not kda_pool_fits(t, s, b.H, b.K, b.W):
                raise ValueError("decode_stack: a KDA pool disagrees with its layer")
            tails[i], states[i] = t.data_ptr(), s.data_ptr()
        for i, (r, *_) in zip(plan.mla_layers, mla_views):
            m = plan.struct.layers[i].mla.contents
            if not (r.dtype == torch.bfloat16 and r.is_contiguous() and r.dim() == 2 and r.shape[1] == m.rank + m.rope):
                raise ValueError("decode_stack: an MLA pool disagrees with its layer")
            rows[i] = r.data_ptr()
        if len(num_slots) > 1 or len(num_rows) > 1:
            raise ValueError("decode_stack: the layers' pools differ in size")
        pools = (tails, states, rows, num_slots.pop() if num_slots else 0, num_rows.pop() if num_rows else 0)
        plan.pools = (key, pools)
        return pools

    def sigmoid_mul(self, o: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """`o * sigmoid(gate)` of bf16 tensors of one shape, rounded as torch rounds it (twice)."""
        if not (o.dtype == gate.dtype == torch.bfloat16 and o.shape == gate.shape):
            raise ValueError("sigmoid_mul: operand shapes or dtypes disagree")
        o, gate = o.contiguous(), gate.contiguous()
        out = torch.empty_like(o)
        self.lib.ds_sigmoid_mul_bf16(o.data_ptr(), gate.data_ptr(), o.numel(), out.data_ptr(), torch.get_num_threads())
        return out


def _layer_fits(y: StackLayerPlan, d: int, block_size: int | None) -> bool:
    """Whether a layer's plan fits `ds_decode_stack` (a callable attention is called back)."""
    mla = isinstance(y.attn, MlaBlockPlan)
    if not callable(y.attn) and (not isinstance(y.attn, (KdaBlockPlan, MlaBlockPlan)) or y.attn.D != d):
        return False
    if mla and not _bf16(y.o_proj, (d, y.attn.H * y.attn.v)):
        return False
    if (y.moe is None) == (y.mlp is None) or (y.moe is not None and y.moe.D != d):
        return False
    if y.mlp is not None:
        width = y.mlp[0].shape[0]
        if not all(_bf16(w, s) for w, s in zip(y.mlp, ((width, d), (width, d), (d, width)))):
            return False
    qs = (y.attn_q, y.mlp_q)
    return all(_f32(t, d) for t in (*qs, y.attn_norm[0], y.mlp_norm[0])) and not any(
        (t is None) != (block_size is None) for t in qs
    )


def _fill_layer(s: StackLayerStruct, y: StackLayerPlan) -> None:
    """A layer's struct from its plan (its attention pointer set by the caller)."""
    s.o_proj = _ptr(y.o_proj)
    s.moe = None if y.moe is None else ctypes.pointer(y.moe)
    s.mlp_gate, s.mlp_up, s.mlp_down = (None,) * 3 if y.mlp is None else (w.data_ptr() for w in y.mlp)
    s.mlp_width = 0 if y.mlp is None else y.mlp[0].shape[0]
    s.act, s.beta, s.lbeta = y.act
    s.attn_q, s.mlp_q = _ptr(y.attn_q), _ptr(y.mlp_q)
    (s.attn_norm, s.attn_eps), (s.mlp_norm, s.mlp_eps) = ((n.data_ptr(), e) for n, e in (y.attn_norm, y.mlp_norm))


def _widths(layers: list[StackLayerPlan], d: int) -> list[int]:
    """The input widths of the step's GEMVs (the rows a multi-row kernel can take depend on them)."""
    widths = [d]
    for y in layers:
        a = y.attn
        if isinstance(a, (KdaBlockPlan, MlaBlockPlan)):
            widths += [a.q_rank or d, a.H * a.v] if isinstance(a, MlaBlockPlan) else [a.K, a.H * a.K]
        widths += [y.moe.L] if y.moe is not None and y.moe.down else []
    return widths
