"""Tokenizers of the tiny models of both families, shared by the chat-format tests."""

import pytest

from deltaserve.model.tokenizer import Tokenizer
from deltaserve.tiny import make_tiny


@pytest.fixture(scope="module")
def k3(tmp_path_factory):
    return Tokenizer.from_pretrained(make_tiny(tmp_path_factory.mktemp("k3"), family="kimi_k3"))


@pytest.fixture(scope="module")
def kl_dir(tmp_path_factory):
    return make_tiny(tmp_path_factory.mktemp("kl"), family="kimi_linear")


@pytest.fixture(scope="module")
def kl(kl_dir):
    return Tokenizer.from_pretrained(kl_dir)
