"""`FakeDevice`: a CPU stand-in for a GPU that reports what would stall or fail on one.

Under the mode every tensor is "on the device" or "on the host", as it would be on CUDA: factory
calls with an explicit `device` other than the string "cpu", `.to(<device>)`, anything computed
from a device tensor and every `nn.Parameter` are device tensors; factories without a device (or
with "cpu"), `.cpu()` and `.to("cpu")` make host tensors. While `active`, each call made from a
file under `package` is checked, and findings are counted by (kind, op, file:line):

- `sync`: the host reads a device value (`.item()`, `.tolist()`, `int()`/`bool()`, `.cpu()`,
  `.to("cpu")`) or an op sizes its output from device data (`nonzero`, `unique`, `bincount`,
  `masked_select`, boolean-mask indexing, `repeat_interleave` without `output_size`);
- `h2d`: a blocking host-to-device copy (`.to(<device>)` without `non_blocking=True`,
  `torch.tensor(data, device=...)`), or a host index tensor indexing a device tensor;
- `mix`: an op (other than copies and indexing) given device tensors and a host tensor with
  elements (CUDA refuses it).

Files whose path contains one of `allow_sync` may sync (the sampler's output read). Run the engine
with device "cpu:0" so its own tensors count as device ones.
"""

from __future__ import annotations

import collections
import sys

import torch
from torch.overrides import TorchFunctionMode


class DeviceTensor(torch.Tensor):
    """A tensor the mode treats as living on the device (no behaviour of its own)."""

    __torch_function__ = torch._C._disabled_torch_function_impl


_FACTORIES = {torch.empty, torch.zeros, torch.ones, torch.full, torch.arange, torch.tensor, torch.as_tensor}
_FROM_DATA = {torch.tensor, torch.as_tensor}
_SYNCS = {
    torch.Tensor.tolist, torch.Tensor.item, torch.Tensor.__bool__, torch.Tensor.__int__, torch.Tensor.__index__,
    torch.Tensor.__float__, torch.Tensor.numpy, torch.Tensor.nonzero, torch.nonzero, torch.unique,
    torch.Tensor.unique, torch.unique_consecutive, torch.bincount, torch.Tensor.bincount, torch.masked_select,
    torch.Tensor.masked_select,
}  # fmt: skip
_REPEATS = {torch.repeat_interleave, torch.Tensor.repeat_interleave}
_INDEXING = {torch.Tensor.__getitem__, torch.Tensor.__setitem__}
_NOT_COMPUTE = {torch.Tensor.copy_, torch.Tensor.data_ptr, torch.Tensor.__repr__, torch.Tensor.__format__}


def on_device(t: torch.Tensor) -> bool:
    return isinstance(t, (DeviceTensor, torch.nn.Parameter))


def _tensors(xs):
    for x in xs:
        if isinstance(x, (list, tuple)):
            yield from _tensors(x)
        elif isinstance(x, torch.Tensor):
            yield x


def _to_device(out):
    if isinstance(out, torch.Tensor):
        return out if on_device(out) else out.as_subclass(DeviceTensor)
    if isinstance(out, tuple):
        items = tuple(_to_device(o) for o in out)
        return items if type(out) is tuple else type(out)(items)  # torch.return_types keep their type
    if isinstance(out, list):
        return [_to_device(o) for o in out]
    return out


class FakeDevice(TorchFunctionMode):
    """See the module docstring. `found`: Counter of findings; `checked`: calls on device tensors
    checked while active (how much the check saw)."""

    def __init__(self, package: str = "/deltaserve/", allow_sync: tuple[str, ...] = ()):
        super().__init__()
        self.package, self.allow_sync = package, allow_sync
        self.active = False
        self.found: collections.Counter = collections.Counter()
        self.checked = 0

    def _site(self, kind: str) -> str | None:
        frame = sys._getframe(3)
        while frame is not None:
            path = frame.f_code.co_filename
            if self.package in path:
                if kind == "sync" and any(a in path for a in self.allow_sync):
                    return None
                return f"{path.split(self.package)[-1]}:{frame.f_lineno}"
            frame = frame.f_back
        return None

    def _flag(self, kind: str, func) -> None:
        if self.active:
            site = self._site(kind)
            if site is not None:
                self.found[(kind, getattr(func, "__name__", str(func)), site)] += 1

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        tensors = list(_tensors([*args, *kwargs.values()]))
        device_in = any(on_device(t) for t in tensors)
        self.checked += int(self.active and device_in)
        if func in _FACTORIES:
            out = func(*args, **kwargs)
            if kwargs.get("device") in (None, "cpu"):
                return out
            if func in _FROM_DATA:
                self._flag("h2d", func)
            return _to_device(out)
        if func is torch.Tensor.to or func is torch.Tensor.cpu:
            return self._move(func, args, kwargs)
        self._check(func, args, kwargs, tensors, device_in)
        out = func(*args, **kwargs)
        return _to_device(out) if device_in and isinstance(out, (torch.Tensor, tuple, list)) else out

    def _move(self, func, args, kwargs):
        src = args[0]
        target = kwargs.get("device")
        if func is torch.Tensor.to and target is None:
            target = next((a for a in args[1:] if isinstance(a, (str, torch.device))), None)
        out = func(*args, **kwargs)
        if func is torch.Tensor.cpu or target == "cpu":
            if on_device(src):
                self._flag("sync", func)
            return out.as_subclass(torch.Tensor) if isinstance(out, DeviceTensor) else out
        if target is not None and not on_device(src) and src.dim() > 0 and not kwargs.get("non_blocking"):
            self._flag("h2d", func)
        return _to_device(out) if target is not None or on_device(src) else out

    def _check(self, func, args, kwargs, tensors, device_in) -> None:
        if not device_in:
            return
        if func in _SYNCS or (func in _REPEATS and "output_size" not in kwargs):
            self._flag("sync", func)
        elif func in _INDEXING:
            index = args[1] if isinstance(args[1], tuple) else (args[1],)
            for i in _tensors(index):
                if i.dtype == torch.bool:
                    self._flag("sync", func)
                elif not on_device(i) and i.dim() > 0 and on_device(args[0]):
                    self._flag("h2d", func)
            value = args[2] if func is torch.Tensor.__setitem__ else None
            if isinstance(value, torch.Tensor) and not on_device(value) and value.dim() > 0:
                self._flag("mix", func)
        elif func not in _NOT_COMPUTE and any(not on_device(t) and t.dim() > 0 for t in tensors):
            self._flag("mix", func)


def watch_steps(mode: FakeDevice, monkeypatch) -> None:
    """Check every engine step under `mode`: `ModelRunner.execute` (the step's layout, the vision
    encoder's rows, the forward pass, logits and the sampler) runs with `mode.active` set."""
    from deltaserve.engine.exec.runner import ModelRunner

    execute = ModelRunner.execute

    def checked(self, *args, **kwargs):
        mode.active = True
        try:
            return execute(self, *args, **kwargs)
        finally:
            mode.active = False

    monkeypatch.setattr(ModelRunner, "execute", checked)


def step_workload(llm, image=None) -> list[list[int]]:
    """Tokens of a workload that takes every path of a step: a prefill exporting KDA checkpoints,
    a prefill over its cached prefix (absorbed MLA), decode, a sampler with penalties, top-k/top-p
    and logprobs, a JSON-constrained request with banned ids (`min_tokens`), and with `image` (a
    PIL image; K3) a chat turn that runs the vision encoder."""
    from deltaserve import SamplingParams
    from deltaserve.engine.request.structured import StructuredOutput

    params = SamplingParams(
        max_tokens=5, temperature=0.7, top_p=0.9, top_k=20, repetition_penalty=1.1, presence_penalty=0.2,
        logprobs=2, seed=1, ignore_eos=True,
    )  # fmt: skip
    shared = list(range(300, 317))
    outs = [llm.generate([p], params, use_tqdm=False)[0] for p in (shared, shared + [5, 6, 7])]
    constrained = SamplingParams(max_tokens=6, temperature=0, min_tokens=2, structured=StructuredOutput.json())
    outs += llm.generate([list(range(40, 52))], constrained, use_tqdm=False)
    if image is not None:
        turn = [{"type": "text", "text": "what is this?"}, {"type": "image_pil", "image_pil": image}]
        outs += llm.chat([{"role": "user", "content": turn}], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]
