"""deltaserve: a serving engine for the Kimi K3 / Kimi-Linear hybrid model family."""

__version__ = "0.1.0"
