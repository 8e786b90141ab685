"""Routed experts of one projection, read per expert from the checkpoint, stacked into the
model's `[E, O, I]` layout: decoded to the compute dtype (`stack_experts`) or kept MXFP4-packed
(`stack_packed`). Both return (stacked or None, problems naming the offending expert tensors).
`per_expert` is keyed by checkpoint expert index; a stack of `shape[0]` experts takes the experts
[first, first + shape[0]) (an expert-parallel rank's slice), expert e at local index e - first."""

from __future__ import annotations

import torch

from ..ops.mxfp4 import mxfp4_decode, mxfp4_validate


def stack_experts(name, per_expert, shape, dtype, device, first=0):
    """Stack `{prefix}.{e}.{proj}` tensors into `[E, O, I]`; problems name the expert tensors."""
    num, out_dim, in_dim = shape
    prefix, _, proj = name.rpartition(".")
    problems = []
    held = range(first, first + num)
    if sorted(per_expert) != list(held):
        absent = [f"{prefix}.{e}.{proj} (missing)" for e in sorted(set(held) - set(per_expert))]
        extra = [f"{prefix}.{e}.{proj} (unexpected)" for e in sorted(set(per_expert) - set(held))]
        return None, absent + extra
    out = torch.empty(shape, dtype=dtype, device=device)
    for e in held:
        parts, where = per_expert[e], f"{prefix}.{e}.{proj}"
        if sorted(parts) not in (["weight"], ["weight_packed", "weight_scale"]):
            problems.append(
                f"{where}: needs either 'weight' or both 'weight_packed' and 'weight_scale', got {sorted(parts)}"
            )
            continue
        if "weight" in parts:
            w = parts["weight"]
            if not w.is_floating_point():
                problems.append(f"{where}.weight: {w.dtype} (expected a floating dtype)")
                continue
        else:
            try:
                w = mxfp4_decode(parts["weight_packed"], parts["weight_scale"], dtype)
            except ValueError as err:
                problems.append(f"{where}: {err}")
                continue
        if tuple(w.shape) != (out_dim, in_dim):
            problems.append(f"{where}: {tuple(w.shape)} != expected {(out_dim, in_dim)}")
            continue
        out[e - first] = w
    return (None if problems else out), problems


def stack_packed(name, per_expert, shape, dtype, device, first=0):
    """Stack MXFP4 experts into (packed [E, O, I/2], scale [E, O, I/32]) uint8, validated."""
    num, out_dim, in_dim = shape
    prefix, _, proj = name.rpartition(".")
    if sorted(per_expert) != list(range(first, first + num)):
        return stack_experts(name, per_expert, shape, dtype, device, first)
    codes = torch.empty(num, out_dim, in_dim // 2, dtype=torch.uint8, device=device)
    scales = torch.empty(num, out_dim, in_dim // 32, dtype=torch.uint8, device=device)
    problems = []
    for e in range(first, first + num):
        parts, where = per_expert[e], f"{prefix}.{e}.{proj}"
        if sorted(parts) != ["weight_packed", "weight_scale"]:
            problems.append(f"{where}: needs both 'weight_packed' and 'weight_scale', got {sorted(parts)}")
            continue
        try:
            rows, cols = mxfp4_validate(parts["weight_packed"], parts["weight_scale"])
        except ValueError as err:
            problems.append(f"{where}: {err}")
            continue
        if (rows, cols) != (out_dim, in_dim):
            problems.append(f"{where}: {(rows, cols)} != expected {(out_dim, in_dim)}")
            continue
        codes[e - first], scales[e - first] = parts["weight_packed"], parts["weight_scale"]
    return (None if problems else (codes, scales)), problems
