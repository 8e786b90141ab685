"""Which sequences run in the next step and with how many tokens: the scheduler (continuous
batching, chunked prefill, preemption) and the admission of a disaggregated handoff's
reservation (`handoff.py`). Imports only `engine.request` of the engine."""
