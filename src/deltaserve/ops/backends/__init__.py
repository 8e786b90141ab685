"""The kernel seam: one backend class per kind of kernel, chosen once at load (`select.py`).
`torch.py` is `TorchOps`, the reference and default (the pure-PyTorch ops of `deltaserve.ops`);
`cpu.py` (+ `cpu_dense.py`, `cpu_stack.py`) the native CPU kernels; `triton.py` (+
`triton_dense.py`) the Triton kernels and the adapters of `kernels.extern`. Every method answers:
where a fast kernel does not fit its operands, the backend runs the reference op itself."""
