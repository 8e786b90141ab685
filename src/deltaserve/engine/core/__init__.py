"""The core loop (`loop.py`: EngineCore add / abort / step, stop checks, counters) and the builder
that makes one from an EngineConfig (`builder.py`: model, tokenizer, pools, kernels, ranks)."""
