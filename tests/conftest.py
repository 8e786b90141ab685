"""Suite-wide: tiktoken's cache directory points at one session temp dir (nothing is fetched or
written outside it). Session scope, so module-scoped fixtures that load tokenizers see it too."""

import pytest


@pytest.fixture(autouse=True, scope="session")
def _tiktoken_cache(tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path_factory.mktemp("tiktoken")))
        yield
