"""Random-weight checkpoints in the real Hugging Face layout, for tests, benchmarks and the
embedded default model (`deltaserve make-tiny`, `deltaserve serve` without a MODEL_DIR).
Sits above `model` in the layering: it may import model and ops, never the reverse."""

from .checkpoint import make_tiny, param_count
from .presets import FAMILIES, PRESETS

__all__ = ["FAMILIES", "PRESETS", "make_tiny", "param_count"]
