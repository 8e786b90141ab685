"""A step's small index tensors between the host and the device, without stalling the host.

The engine builds a step's layout (token ids, `cu_seqlens`, slots, page rows) on the host. On a GPU
`to_device` sends it in one asynchronous copy from one pinned staging buffer, and every device
tensor it returns remembers the host tensor it came from: planners that need the values on the
host (chunk plans, length buckets) read them through `host_copy`, never back from the device (a
device-to-host read waits for every kernel queued before it). On CPU both are the same tensors.

Invariant: a tensor made by `to_device` is never written in place (its host copy would go stale).
"""

from __future__ import annotations

import torch

_HOST = "_deltaserve_host"


def to_device(host: dict[str, torch.Tensor], device: torch.device | str) -> dict[str, torch.Tensor]:
    """`host`'s int64 tensors on `device` under the same keys; each result's `host_copy` is its
    host tensor. CUDA: one pinned buffer, one non-blocking copy, then views. Elsewhere `.to`."""
    device = torch.device(device)
    if any(t.dtype != torch.long or t.device.type != "cpu" for t in host.values()):
        raise ValueError("to_device: host int64 tensors only")
    if device.type != "cuda" or not host:
        out = {k: t.to(device, non_blocking=True) for k, t in host.items()}
    else:
        parts = [t.reshape(-1) for t in host.values()]
        staged = torch.empty(sum(p.numel() for p in parts), dtype=torch.long, pin_memory=True)
        torch.cat(parts, out=staged)
        flat = staged.to(device, non_blocking=True).split([p.numel() for p in parts])
        out = {k: f.view(t.shape) for (k, t), f in zip(host.items(), flat)}
    for k, t in out.items():
        if t is not host[k]:
            setattr(t, _HOST, host[k])
    return out


def tensor_on(values, device: torch.device | str, dtype: torch.dtype = torch.long) -> torch.Tensor:
    """`values` (a list) as a tensor on `device`: built on the host, copied without blocking
    (`torch.tensor(values, device=...)` would wait for the device)."""
    return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)


def host_copy(t: torch.Tensor) -> torch.Tensor:
    """`t`'s values on the host: the tensor `to_device` made it from, `t` itself on CPU, else a
    copy (which waits for the device)."""
    h = getattr(t, _HOST, None)
    if h is not None:
        return h
    return t if t.device.type == "cpu" else t.to("cpu")
