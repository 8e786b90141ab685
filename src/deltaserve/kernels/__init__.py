"""Compiled kernels, below `ops`: `cpu/` (C sources, their build and ctypes bindings) and the
plans they share (`chunking.py`). Nothing here imports ops, model, cache, engine or server; a
kernel is reached through an op that falls back to PyTorch where the kernel is unavailable."""
