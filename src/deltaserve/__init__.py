"""deltaserve: a serving engine for the Kimi K3 / Kimi-Linear hybrid model family."""

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams"]


def __getattr__(name: str):
    """`LLM` and `SamplingParams` load lazily, so the CLI starts without importing torch."""
    if name == "LLM":
        from .engine.llm import LLM

        return LLM
    if name == "SamplingParams":
        from .engine.request.sampling_params import SamplingParams

        return SamplingParams
    raise AttributeError(f"module 'deltaserve' has no attribute {name!r}")
