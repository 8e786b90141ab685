"""nn.Modules composed from ops, the config parser and the checkpoint loader."""

from .config import ConfigError, ModelConfig
from .kimi import KimiForCausalLM
from .weights import CheckpointError, load_model, resolve_dtype

__all__ = ["CheckpointError", "ConfigError", "KimiForCausalLM", "ModelConfig", "load_model", "resolve_dtype"]
