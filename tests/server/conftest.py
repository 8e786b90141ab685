"""One real server (tiny random K3, API key, 1 MiB body cap) shared by the package's modules;
a module that needs other settings defines its own `server` fixture."""

import pytest

from tests.server.live_server import KEY, MAX_LEN, MODEL, live_server


@pytest.fixture(scope="package")
def server(tmp_path_factory):
    with live_server(tmp_path_factory, MODEL, dict(api_key=KEY, max_body_bytes=1 << 20), max_model_len=MAX_LEN) as srv:
        yield srv


@pytest.fixture(scope="package")
def client(server):
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url=server["url"] + "/v1", api_key=KEY, max_retries=0, timeout=60)
