"""ctypes bindings of the attention decode kernels: the in-place KDA decode step over the slot
pool and the absorbed MLA decode over the paged latent rows. Each method checks dtypes, shapes and
contiguity, then calls `self.lib` (see `library.py`)."""

from __future__ import annotations

import ctypes

import torch

from .abi import MLA_MAX_HEADS, MLA_MAX_RANK

FLASH_PACK_BYTES = 256 << 20  # the flash kernel's keys and values packed ahead, at most


def kda_pool_fits(tails: torch.Tensor, states: torch.Tensor, heads: int, head_dim: int, width: int) -> bool:
    """Whether (tails [S, W-1, 3HK] bf16, states [S, H, K, K] fp32) is a contiguous KDA slot pool
    for a layer of `heads` x `head_dim` with a conv of `width`: what the in-place kernels write."""
    return (
        tails.dtype == torch.bfloat16
        and tails.is_contiguous()
        and tuple(tails.shape[1:]) == (width - 1, 3 * heads * head_dim)
        and states.dtype == torch.float32
        and states.is_contiguous()
        and tuple(states.shape[1:]) == (heads, head_dim, head_dim)
        and tails.shape[0] == states.shape[0]
    )


class AttentionDecodeBindings:
    """Mixin of `NativeKernels` (`self.lib`: the library, its signatures declared from ds_abi.h)."""

    lib: ctypes.CDLL

    def kda_decode(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        conv_weight: torch.Tensor,
        tails: torch.Tensor,
        states: torch.Tensor,
        slots: torch.Tensor,
        f: torch.Tensor,
        a_log: torch.Tensor,
        dt_bias: torch.Tensor,
        gate_kind: int,
        lower_bound: float,
        b_logit: torch.Tensor,
        gate: torch.Tensor,
        norm_weight: torch.Tensor,
        eps: float,
        scale: float,
    ) -> torch.Tensor:
        """One decode token per sequence of one KDA layer (see `ds_kda_decode`), updating
        `tails` [S, W-1, 3P] bf16 and `states` [S, H, K, K] fp32 at `slots` IN PLACE.
        q, k, v, f, gate: [B, P] bf16 projections; b_logit [B, H] bf16; conv_weight [3P, W],
        a_log [H], dt_bias [P], norm_weight [K] fp32. Returns the normed, gated output [B, P] bf16."""
        bsz, p = q.shape
        _, h, kd, _ = states.shape
        w = conv_weight.shape[1]
        bf = (q, k, v, f, gate, b_logit)
        ok = (
            p == h * kd
            and all(t.dtype == torch.bfloat16 and t.is_contiguous() for t in bf)
            and all(tuple(t.shape) == (bsz, p) for t in (k, v, f, gate))
            and tuple(b_logit.shape) == (bsz, h)
            and kda_pool_fits(tails, states, h, kd, w)
            and slots.dtype == torch.int64
            and slots.numel() == bsz
            and all(t.dtype == torch.float32 and t.is_contiguous() for t in (conv_weight, a_log, dt_bias, norm_weight))
            and tuple(conv_weight.shape) == (3 * p, w)
            and a_log.numel() == h
            and dt_bias.numel() == p
            and norm_weight.numel() == kd
            and w >= 1
        )
        if not ok:
            raise ValueError("kda_decode: operand shapes or dtypes disagree")
        slots = slots.contiguous()
        if bsz and (int(slots.min()) < 0 or int(slots.max()) >= states.shape[0]):
            raise ValueError("kda_decode: slot out of range")
        out = torch.empty(bsz, p, dtype=torch.bfloat16)
        rc = self.lib.ds_kda_decode(
            bsz,
            h,
            kd,
            w,
            q.data_ptr(),
            k.data_ptr(),
            v.data_ptr(),
            conv_weight.data_ptr(),
            tails.data_ptr(),
            states.data_ptr(),
            slots.data_ptr(),
            f.data_ptr(),
            a_log.data_ptr(),
            dt_bias.data_ptr(),
            gate_kind,
            lower_bound,
            b_logit.data_ptr(),
            gate.data_ptr(),
            norm_weight.data_ptr(),
            eps,
            scale,
            out.data_ptr(),
            torch.get_num_threads(),
        )
        if rc != 0:
            raise MemoryError("kda_decode: scratch allocation failed")
        return out

    def mla_decode(
        self,
        q_latent: torch.Tensor,
        rows: torch.Tensor,
        read_rows: torch.Tensor,
        cu_kv: torch.Tensor,
        kv_lora_rank: int,
        scale: float,
    ) -> torch.Tensor:
        """Absorbed MLA attention of one query per sequence over its paged context (see
        `ds_mla_decode`): q_latent [B, H, R + Dr] bf16, rows [num_rows, R + Dr] bf16 (the pool),
        read_rows int64 (each sequence's context rows, packed by cu_kv [B + 1]).
        Returns [B, H, R] bf16; `ops.mla.mla_absorbed_attention` is the reference."""
        bsz, h, _ = q_latent.shape
        out = torch.empty(bsz, h, kv_lora_rank, dtype=torch.bfloat16)
        self._mla_decode(self.lib.ds_mla_decode, 1, q_latent, rows, read_rows, cu_kv, kv_lora_rank, scale, out)
        return out

    def mla_decode_partial(
        self,
        q_latent: torch.Tensor,
        rows: torch.Tensor,
        read_rows: torch.Tensor,
        cu_kv: torch.Tensor,
        kv_lora_rank: int,
        scale: float,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`mla_decode` over this rank's share of each context (decode context parallelism; a
        sequence may have no row here): (o [B, H, R] fp32, normalised over its rows here, lse [B, H]
        fp32, o = 0 and lse = -inf without rows), what `ops.mla.mla_absorbed_partial` returns for one
        query per sequence that sees all of them."""
        bsz, h, _ = q_latent.shape
        out = torch.empty(bsz, h, kv_lora_rank, dtype=torch.float32)
        lse = torch.empty(bsz, h, dtype=torch.float32)
        self._mla_decode(
            self.lib.ds_mla_decode_partial, 0, q_latent, rows, read_rows, cu_kv, kv_lora_rank, scale, out, lse
        )
        return out, lse

    def _mla_decode(
        self, fn, least: int, q_latent, rows, read_rows, cu_kv, kv_lora_rank: int, scale: float, *outs
    ) -> None:
        """Checks the operands of `fn` (`ds_mla_decode` or its partial form; each sequence with at least
        `least` context rows) and calls it."""
        bsz, h, d = q_latent.shape
        ok = (
            q_latent.dtype == rows.dtype == torch.bfloat16
            and rows.dim() == 2
            and rows.shape[1] == d
            and rows.is_contiguous()
            and read_rows.dtype == cu_kv.dtype == torch.int64
            and cu_kv.numel() == bsz + 1
            and 0 < kv_lora_rank <= min(d, MLA_MAX_RANK)
            and h <= MLA_MAX_HEADS
        )
        if not ok:
            raise ValueError("mla_decode: operand shapes or dtypes disagree")
        q_latent, read_rows, cu_kv = q_latent.contiguous(), read_rows.contiguous(), cu_kv.contiguous()
        lens = cu_kv[1:] - cu_kv[:-1]
        if bsz and (int(cu_kv[0]) != 0 or int(cu_kv[-1]) != read_rows.numel() or bool((lens < least).any())):
            raise ValueError(f"mla_decode: every sequence needs at least {least} context row(s)")
        if read_rows.numel() and (int(read_rows.min()) < 0 or int(read_rows.max()) >= rows.shape[0]):
            raise ValueError("mla_decode: row index out of range")
        rc = fn(
            bsz,
            h,
            d,
            kv_lora_rank,
            q_latent.data_ptr(),
            rows.data_ptr(),
            read_rows.data_ptr(),
            cu_kv.data_ptr(),
            scale,
            *(t.data_ptr() for t in outs),
            torch.get_num_threads(),
        )
        if rc != 0:
            raise MemoryError("mla_decode: scratch allocation failed")

    def flash_attention(
        self,
        q: torch.Tensor,
        k_nope: torch.Tensor,
        k_rot: torch.Tensor,
        v: torch.Tensor,
        cu_q: torch.Tensor,
        cu_kv: torch.Tensor,
        scale: float,
        group: int = 1,
        pack_bytes: int = FLASH_PACK_BYTES,
    ) -> torch.Tensor | None:
        """Causal attention of the packed queries q [group * Nq, H, Dn + Dr] (`group` rows a position,
        cu_q counting positions) over each sequence's rows: keys [k_nope [Nkv, H, Dn] | k_rot [Nkv, Dr]
        shared by the heads], values v [Nkv, H, Dv] (see `ds_flash_attention`; views with a contiguous
        last dim are read in place, a head stride of 0 included). Returns [group * Nq, H, Dv] bf16,
        the values of `ops.mla.mla_context_attention` (group 1) or `mla_absorbed_attention` (the heads
        folded into rows, group = heads); None where the build lacks AVX512-BF16. `pack_bytes` bounds
        the keys and values packed ahead (past one head's, each task packs the block it reads)."""
        nq, h, dqk = q.shape
        nkv, _, dn = k_nope.shape
        dr, dv = k_rot.shape[-1], v.shape[-1]
        ok = (
            all(t.dtype == torch.bfloat16 and t.stride(-1) == 1 for t in (q, k_nope, k_rot, v))
            and dqk == dn + dr
            and tuple(k_nope.shape[:2]) == (nkv, h)
            and tuple(v.shape[:2]) == (nkv, h)
            and tuple(k_rot.shape) == (nkv, dr)
            and cu_q.dtype == cu_kv.dtype == torch.int64
            and cu_q.numel() == cu_kv.numel() >= 1
            and group >= 1
        )
        if not ok:
            raise ValueError("flash_attention: operand shapes or dtypes disagree")
        cu_q, cu_kv = cu_q.contiguous(), cu_kv.contiguous()
        if int(cu_q[0]) != 0 or int(cu_kv[0]) != 0 or int(cu_q[-1]) * group != nq or int(cu_kv[-1]) != nkv:
            raise ValueError("flash_attention: cu_q / cu_kv do not span the rows")
        out = torch.empty(nq, h, dv, dtype=torch.bfloat16)
        rc = self.lib.ds_flash_attention(
            cu_q.numel() - 1,
            h,
            group,
            dn,
            dr,
            dv,
            q.data_ptr(),
            q.stride(0),
            q.stride(1),
            k_nope.data_ptr(),
            k_nope.stride(0),
            k_nope.stride(1),
            k_rot.data_ptr() if dr else None,
            k_rot.stride(0),
            v.data_ptr(),
            v.stride(0),
            v.stride(1),
            cu_q.data_ptr(),
            cu_kv.data_ptr(),
            scale,
            pack_bytes,
            out.data_ptr(),
            torch.get_num_threads(),
        )
        if rc == -3:
            return None
        if rc == -2:
            raise ValueError("flash_attention: every sequence needs at least as many rows as queries")
        if rc != 0:
            raise MemoryError("flash_attention: scratch allocation failed")
        return out
