"""Running a scheduled step: schedule -> `Step` -> `ForwardBatch` (`step_batch.py`), the model
runner and sampler, the encoder cache, and the ranks of a tensor-parallel engine (launch plan,
worker loop, the control channel and its messages, pool snapshots, each rank's transfer engine).
Imports `engine.request` and `engine.sched`, never the core loop."""
