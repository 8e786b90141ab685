"""ctypes bindings of the decode-oriented native kernels (small-M GEMV, fused experts, router,
norms, AttnRes; the KDA and MLA decode steps are in `attention.py`): each method checks dtypes,
shapes and contiguity, then calls `self.lib` (see `library.py`)."""

from __future__ import annotations

import ctypes

import torch

from .abi import AMX_ROWS, GROUP_SIZE, MAX_MIX, MAX_MULTI, MAX_ROWS


def expert_operands(w1, w3, w2, d: int) -> tuple[int, int, bool, list[int]] | None:
    """(E, I, packed, pointers w1, s1, w3, s3, w2, s2 (0 for no scales)) of routed experts over inputs
    of width d, as `ds_moe_experts` reads them: bf16 [E, I, d] / [E, d, I], or (packed, scale) uint8
    pairs [E, I, d/2] + [E, I, d/32] / [E, d, I/2] + [E, d, I/32]; None where they do not fit."""
    if isinstance(w1, tuple):
        (p1, s1), (p3, s3), (p2, s2) = w1, w3, w2
        num, width = p1.shape[0], p1.shape[1]
        ok = (
            tuple(p1.shape) == tuple(p3.shape) == (num, width, d // 2)
            and tuple(p2.shape) == (num, d, width // 2)
            and tuple(s1.shape) == tuple(s3.shape) == (num, width, d // GROUP_SIZE)
            and tuple(s2.shape) == (num, d, width // GROUP_SIZE)
            and d % GROUP_SIZE == 0
            and width % GROUP_SIZE == 0
            and all(t.dtype == torch.uint8 and t.is_contiguous() for t in (p1, s1, p3, s3, p2, s2))
        )
        return (num, width, True, [t.data_ptr() for t in (p1, s1, p3, s3, p2, s2)]) if ok else None
    num, width = w1.shape[0], w1.shape[1]
    ok = (
        tuple(w1.shape) == tuple(w3.shape) == (num, width, d)
        and tuple(w2.shape) == (num, d, width)
        and all(t.dtype == torch.bfloat16 and t.is_contiguous() for t in (w1, w3, w2))
    )
    return (num, width, False, [w1.data_ptr(), 0, w3.data_ptr(), 0, w2.data_ptr(), 0]) if ok else None


class DecodeBindings:
    """Mixin of `NativeKernels` (`self.lib`: the library, its signatures declared from ds_abi.h)."""

    lib: ctypes.CDLL

    @staticmethod
    def _threads() -> int:
        return torch.get_num_threads()

    def linear_bf16(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """x [M <= MAX_ROWS, K] bf16 @ w [N, K] bf16 -> [M, N] bf16 (fp32 accumulation)."""
        m, k = x.shape
        n = w.shape[0]
        if not (x.dtype == w.dtype == torch.bfloat16 and w.shape[1] == k and m <= MAX_ROWS):
            raise ValueError(f"linear_bf16: bad operands {tuple(x.shape)} {x.dtype} @ {tuple(w.shape)} {w.dtype}")
        x, w = x.contiguous(), w.contiguous()
        y = torch.empty(m, n, dtype=torch.bfloat16)
        self.lib.ds_linear_bf16(x.data_ptr(), m, k, w.data_ptr(), n, y.data_ptr(), n, self._threads())
        return y

    MAX_MULTI = MAX_MULTI

    def linear_bf16_multi(
        self, x: torch.Tensor, weights: list[torch.Tensor], f32: list[bool] | None = None
    ) -> list[torch.Tensor]:
        """`[x @ w.T for w in weights]` in one native call: x [M, K] bf16 (M <= MAX_ROWS, or any M on
        tiles (AMX or AVX512-BF16 registers), in passes of AMX_ROWS), each w [N_i, K] bf16 contiguous;
        output i is fp32 where f32[i] (the unrounded fp32 accumulation), else bf16."""
        m, k = x.shape
        f32 = f32 or [False] * len(weights)
        if not (
            x.dtype == torch.bfloat16
            and 0 < m
            and (m <= MAX_ROWS or self.multi_rows(k) > MAX_ROWS)
            and 0 < len(weights) == len(f32) <= self.MAX_MULTI
            and all(
                w.dtype == torch.bfloat16 and w.dim() == 2 and w.shape[1] == k and w.is_contiguous() for w in weights
            )
        ):
            raise ValueError("linear_bf16_multi: bad operands")
        x = x.contiguous()
        ys = [torch.empty(m, w.shape[0], dtype=torch.float32 if f else torch.bfloat16) for w, f in zip(weights, f32)]
        nw = len(weights)
        fn = self.lib.ds_linear_bf16_multi if m <= MAX_ROWS else self.lib.ds_linear_amx_multi
        rc = fn(
            x.data_ptr(),
            m,
            k,
            (ctypes.c_void_p * nw)(*[w.data_ptr() for w in weights]),
            (ctypes.c_int * nw)(*[w.shape[0] for w in weights]),
            (ctypes.c_int * nw)(*[int(f) for f in f32]),
            (ctypes.c_void_p * nw)(*[y.data_ptr() for y in ys]),
            nw,
            self._threads(),
        )
        if rc != 0:
            raise MemoryError("linear_bf16_multi: scratch allocation failed")
        return ys

    def multi_rows(self, k: int) -> int:
        """The most rows worth one `linear_bf16_multi` call for inputs of width k (more go to oneDNN
        GEMMs): AMX_ROWS on tiles (k a multiple of 32), else MAX_ROWS."""
        return AMX_ROWS if self.tiles and k % GROUP_SIZE == 0 else MAX_ROWS

    def linear_bf16_heads(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """Per-head `x[h] @ w[h].T`: x [H, M <= MAX_ROWS, K], w [H, N, K], both bf16 -> [H, M, N]."""
        h, m, k = x.shape
        if not (
            x.dtype == w.dtype == torch.bfloat16
            and w.dim() == 3
            and w.shape[0] == h
            and w.shape[2] == k
            and m <= MAX_ROWS
        ):
            raise ValueError(f"linear_bf16_heads: bad operands {tuple(x.shape)} @ {tuple(w.shape)}")
        x, w = x.contiguous(), w.contiguous()
        y = torch.empty(h, m, w.shape[1], dtype=torch.bfloat16)
        self.lib.ds_linear_bf16_heads(x.data_ptr(), h, m, k, w.data_ptr(), w.shape[1], y.data_ptr(), self._threads())
        return y

    def mxfp4_to_bf16(self, packed: torch.Tensor, scale: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """decode(packed [..., N, K/2], scale [..., N, K/32]) -> [..., N, K] bf16, exactly, into
        `out` (contiguous, that shape) or a new tensor. The caller has validated the scales (no 0xFF)."""
        k = packed.shape[-1] * 2
        shape = (*packed.shape[:-1], k)
        if not (
            packed.dtype == scale.dtype == torch.uint8
            and k % GROUP_SIZE == 0
            and tuple(scale.shape) == (*packed.shape[:-1], k // GROUP_SIZE)
            and (out is None or (out.dtype == torch.bfloat16 and tuple(out.shape) == shape and out.is_contiguous()))
        ):
            raise ValueError(f"mxfp4_to_bf16: bad operands packed {tuple(packed.shape)} scale {tuple(scale.shape)}")
        packed, scale = packed.contiguous(), scale.contiguous()
        out = torch.empty(shape, dtype=torch.bfloat16) if out is None else out
        rows = packed.numel() // packed.shape[-1] if packed.numel() else 0
        if rows:
            self.lib.ds_mxfp4_to_bf16(packed.data_ptr(), scale.data_ptr(), rows, k, out.data_ptr(), self._threads())
        return out

    def moe_experts(
        self,
        x: torch.Tensor,
        ids: torch.Tensor,
        weights: torch.Tensor,
        w1,
        w3,
        w2,
        act: int,
        beta: float,
        linear_beta: float | None,
    ) -> torch.Tensor:
        """Fused routed experts for small batches (see `ds_moe_experts`). x [N, D] bf16, ids int64
        and weights fp32 [N, k]; w1/w3/w2 are bf16 tensors [E, I, D] / [E, D, I], or
        (packed, scale) pairs of uint8 tensors. Returns [N, D] bf16."""
        n, d = x.shape
        k = ids.shape[1]
        checked = expert_operands(w1, w3, w2, d)
        if not (checked and x.dtype == torch.bfloat16 and tuple(weights.shape) == tuple(ids.shape) == (n, k)):
            raise ValueError("moe_experts: operand shapes or dtypes disagree")
        num, width, packed, ptrs = checked
        x = x.contiguous()
        ids = ids.to(torch.int64).contiguous()
        weights = weights.to(torch.float32).contiguous()
        out = torch.empty(n, d, dtype=torch.bfloat16)
        rc = self.lib.ds_moe_experts(
            x.data_ptr(),
            n,
            d,
            ids.data_ptr(),
            weights.data_ptr(),
            k,
            num,
            width,
            int(packed),
            *ptrs,
            act,
            beta,
            linear_beta or 0.0,
            out.data_ptr(),
            self._threads(),
        )
        if rc == -2:
            raise ValueError("moe_experts: expert id out of range")
        if rc != 0:
            raise MemoryError("moe_experts: scratch allocation failed")
        return out

    def rms_norm(self, x: torch.Tensor, weight_f32: torch.Tensor, eps: float) -> torch.Tensor:
        """`ops.norms.rms_norm` for bf16 x [N, D] (rows may be strided, columns contiguous) and
        an fp32 weight [D]. Returns a new contiguous [N, D] bf16 tensor."""
        n, d = x.shape
        if not (
            x.dtype == torch.bfloat16
            and (x.stride(1) == 1 or d == 1)
            and weight_f32.dtype == torch.float32
            and weight_f32.is_contiguous()
            and weight_f32.numel() == d
        ):
            raise ValueError("rms_norm: operand shapes or dtypes disagree")
        out = torch.empty(n, d, dtype=torch.bfloat16)
        self.lib.ds_rms_norm(
            x.data_ptr(), x.stride(0), n, d, weight_f32.data_ptr(), eps, out.data_ptr(), d, self._threads()
        )
        return out

    def argmax_rows(self, x: torch.Tensor) -> torch.Tensor:
        """`x.argmax(dim=-1)` of fp32 logits x [N, V] (contiguous, V > 0): the first largest value's
        index, a NaN counting as the largest, as torch chooses. int64 [N]."""
        if not (x.dtype == torch.float32 and x.dim() == 2 and x.is_contiguous() and x.shape[1] > 0):
            raise ValueError("argmax_rows: needs contiguous fp32 [N, V > 0]")
        out = torch.empty(x.shape[0], dtype=torch.int64)
        self.lib.ds_argmax_rows(x.data_ptr(), x.shape[0], x.shape[1], out.data_ptr(), self._threads())
        return out

    MAX_MIX = MAX_MIX

    def attn_res_mix(
        self,
        candidates: list[torch.Tensor],
        q_f32: torch.Tensor,
        eps: float,
        norm_f32: torch.Tensor | None = None,
        norm_eps: float = 0.0,
    ) -> torch.Tensor:
        """`ops.attn_res.attn_res_mix` over `candidates` (the bank, then cur; each [N, D] bf16)
        with the fp32 query q = norm * proj [D]. Returns the mix [N, D] bf16, or with `norm_f32`
        (an RMSNorm's fp32 weight [D]) that norm of the mix, bit-identical to `rms_norm` after it."""
        shape = candidates[-1].shape
        n, d = shape
        bf16 = torch.bfloat16
        if not (
            0 < len(candidates) <= self.MAX_MIX
            and q_f32.dtype == torch.float32
            and q_f32.numel() == d
            and (norm_f32 is None or (norm_f32.dtype == torch.float32 and norm_f32.numel() == d))
        ):
            raise ValueError("attn_res_mix: operand shapes or dtypes disagree")
        # one pass: check each candidate and take its pointer (a contiguous copy kept alive if needed)
        kept, addrs = [], []
        for c in candidates:
            if c.dtype != bf16 or c.shape != shape:
                raise ValueError("attn_res_mix: operand shapes or dtypes disagree")
            if not c.is_contiguous():
                c = c.contiguous()
                kept.append(c)
            addrs.append(c.data_ptr())
        ptrs = (ctypes.c_void_p * len(addrs))(*addrs)
        out = torch.empty(n, d, dtype=torch.bfloat16)
        normed = None if norm_f32 is None else torch.empty(n, d, dtype=torch.bfloat16)
        self.lib.ds_attn_res_mix(
            ptrs,
            len(candidates),
            n,
            d,
            q_f32.contiguous().data_ptr(),
            eps,
            out.data_ptr(),
            None if normed is None else norm_f32.contiguous().data_ptr(),
            norm_eps,
            None if normed is None else normed.data_ptr(),
            self._threads(),
        )
        return out if normed is None else normed

    def route(
        self,
        logits: torch.Tensor,
        correction_bias: torch.Tensor | None,
        top_k: int,
        num_expert_group: int,
        topk_group: int,
        renormalize: bool,
        routed_scaling_factor: float,
        bias_in_weights: bool,
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """`ops.moe.route` after the logits (fp32 [N, E]; see `ds_route`): (weights fp32 [N, k],
        ids int64 [N, k]), or None where the kernel's limits do not hold (the caller falls back)."""
        n, e = logits.shape
        if not (logits.dtype == torch.float32 and (correction_bias is None or correction_bias.numel() == e)):
            raise ValueError("route: logits must be fp32 [N, E] and the bias [E]")
        logits = logits.contiguous()
        bias = None if correction_bias is None else correction_bias.float().contiguous()
        weights = torch.empty(n, top_k, dtype=torch.float32)
        ids = torch.empty(n, top_k, dtype=torch.int64)
        rc = self.lib.ds_route(
            logits.data_ptr(),
            n,
            e,
            0 if bias is None else bias.data_ptr(),
            top_k,
            num_expert_group,
            topk_group,
            int(renormalize),
            routed_scaling_factor,
            int(bias_in_weights),
            weights.data_ptr(),
            ids.data_ptr(),
        )
        return (weights, ids) if rc == 0 else None
