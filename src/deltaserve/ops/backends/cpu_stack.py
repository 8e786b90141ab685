"""`CpuStackOps`: the whole decode step of the decoder stack in one native call (`ds_decode_stack`)
and the MLA output gate it shares with the module path; a mixin of `CpuNativeOps`.

The stack composes the block kernels the layers call one by one, with the same roundings, so a
step's hidden states are bit-identical either way; it saves the Python between ~6 calls a layer.
"""

from __future__ import annotations

import torch

from ...kernels.cpu import NativeKernels
from ...kernels.cpu.stack import StackLayerPlan, StackPlan
from ..attn_res import ATTN_RES_EPS
from ..fallbacks import fallback
from ..stack import StackOperands
from .cpu_dense import act_spec
from .torch import TorchOps


def _act(act) -> tuple[int, float, float]:
    kind, beta, lbeta = act_spec(act)
    return kind, beta, lbeta or 0.0


class CpuStackOps(TorchOps):
    """See the module docstring. `fuse_stack=False` (or `fuse_blocks=False`) builds no stack plan."""

    k: NativeKernels
    fuse_blocks: bool
    fuse_stack: bool

    def sigmoid_gate(self, o, gate):
        if o.dtype == gate.dtype == torch.bfloat16 and o.shape == gate.shape and o.is_cpu:
            return self.k.sigmoid_mul(o, gate)
        if o.numel():
            fallback("sigmoid_gate", "device" if not o.is_cpu else "shape" if o.shape != gate.shape else "dtype")
        return super().sigmoid_gate(o, gate)

    def prepare_stack(self, stack: StackOperands) -> StackPlan | None:
        if not (self.fuse_blocks and self.fuse_stack):
            return None
        layers = []
        for y in stack.layers:
            attn_plan = y.attn if callable(y.attn) else getattr(y.attn, "plan", None)  # or a callback
            moe_plan = None if y.moe is None else y.moe[0]
            if attn_plan is None or (y.mlp is None and moe_plan is None):
                return None
            layers.append(
                StackLayerPlan(
                    attn_plan,
                    y.o_proj,
                    moe_plan,
                    y.mlp,
                    _act(y.act),
                    y.attn_mix,
                    y.mlp_mix,
                    (y.attn_norm.prepared, y.attn_norm.eps),
                    (y.mlp_norm.prepared, y.mlp_norm.eps),
                )
            )
        final = (stack.final_norm.prepared, stack.final_norm.eps)
        return self.k.stack_plan(
            stack.hidden, layers, stack.block_size, ATTN_RES_EPS, stack.out_mix, final, stack.head, stack.reduce
        )

    def decode_stack(self, x, prepared: StackPlan | None, cache, otherwise):
        """One native call for up to `prepared.max_rows` bf16 rows over bf16 pools (fp32 KDA states)
        the cache addresses in place; else, or where the kernel declines the step, `otherwise()`."""
        if prepared is None or x.dtype != torch.bfloat16 or not 0 < x.shape[0] <= prepared.max_rows:
            return otherwise()
        views = self._pool_views(prepared, cache)
        out = None if views is None else self._recorded(prepared, cache, self.k.decode_stack, x, *views)
        return otherwise() if out is None else out

    def decode_logits(self, ids, prepared: StackPlan | None, cache, otherwise):
        """As `decode_stack`, from the token ids to the logits, where the plan holds the embeddings
        and the output head."""
        if (
            prepared is None
            or not prepared.logits
            or ids.device.type != "cpu"
            or not 0 < ids.numel() <= prepared.max_rows
        ):
            return otherwise()
        views = self._pool_views(prepared, cache)
        out = None if views is None else self._recorded(prepared, cache, self.k.decode_logits, ids, *views)
        return otherwise() if out is None else out

    @staticmethod
    def _recorded(prepared: StackPlan, cache, call, *args):
        """`call(prepared, *args)` with the KDA layers' records where the step's cache carries a
        `KdaRecord` (ops/kda_record.py: a speculative verify), each with its layer's block plan; a
        declined step leaves none."""
        record = getattr(cache, "kda_record", None)
        if record is None or not prepared.kda_layers:
            return call(prepared, *args)
        bufs = record.take(prepared.kda_records)
        out = call(prepared, *args, records=bufs)
        if out is None:
            record.drop(prepared.kda_layers)
        return out

    def replay_kda(self, record, views: dict, rows: list[int], slots: list[int]) -> bool:
        """One native call over every KDA layer (`ds_kda_replay`, through the decode kernel's own
        arithmetic), where each of `views`' layers was recorded (`views`: {layer: (tails, states)})."""
        if record is None or not record.covers(list(views)):
            return False
        layers = [(*record.layers[i], *v) for i, v in views.items()]
        as_long = (torch.tensor(t, dtype=torch.long) for t in (rows, slots))
        self.k.kda_replay(layers, record.rows, *as_long)
        return True

    def _pool_views(self, prepared: StackPlan, cache) -> tuple[list, list] | None:
        """Each KDA and MLA layer's pool view as the stack reads them, or None where the cache has
        none or its pools are not bf16 (fp32 KDA states)."""
        kda_view = getattr(cache, "kda_slot_view", None)
        mla_view = getattr(cache, "mla_pool_view", None)
        if (prepared.kda_layers and kda_view is None) or (prepared.mla_layers and mla_view is None):
            return None
        kda_views = [kda_view(i) for i in prepared.kda_layers]
        mla_views = [mla_view(i) for i in prepared.mla_layers]
        if any(v is None for v in mla_views):
            return None
        if kda_views and (kda_views[0][0].dtype != torch.bfloat16 or kda_views[0][1].dtype != torch.float32):
            return None
        if mla_views and mla_views[0][0].dtype != torch.bfloat16:
            return None
        return kda_views, mla_views
