"""Suite-wide: tiktoken's cache directory points at a per-test temp dir (nothing is fetched or
written outside it)."""
import pytest


@pytest.fixture(autouse=True)
def _tiktoken_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path / "tiktoken"))
