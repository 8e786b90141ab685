"""The trained small models shipped in the package (`deltaserve train-tiny` output with its
`training.json`; figures in docs/performance.md): the K3 one is `deltaserve serve`'s default."""

from __future__ import annotations

from pathlib import Path

SHIPPED = {"kimi_k3": "kimi-k3-small-chat", "kimi_linear": "kimi-linear-small-chat"}
ASSETS = Path(__file__).resolve().parent.parent / "assets" / "models"


def shipped_model_dir(family: str = "kimi_k3") -> Path:
    """The shipped trained checkpoint of `family` (read-only package data)."""
    path = ASSETS / SHIPPED[family]
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"the shipped {family} model is missing from {path} (a broken install?)")
    return path
