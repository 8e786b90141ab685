"""`count_kernel_calls`: how often named `NativeKernels` bindings ran (tests assert a path engaged)."""

from collections import Counter

from deltaserve.kernels.cpu.library import NativeKernels


def count_kernel_calls(monkeypatch, names) -> Counter:
    """Wrap each binding in `names` on `NativeKernels` (undone by `monkeypatch`); the returned
    counter counts their calls by name from now on."""
    calls = Counter()
    for name in names:
        real = getattr(NativeKernels, name)

        def counted(self, *a, _real=real, _name=name, **kw):
            calls[_name] += 1
            return _real(self, *a, **kw)

        monkeypatch.setattr(NativeKernels, name, counted)
    return calls
