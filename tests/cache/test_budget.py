"""Choosing the KV budget (`size_layout`): the default is capped by what the workload can use,
an explicit `kv_cache_memory` is honoured as given; exact expectations from the unit costs."""

import logging

import pytest
import torch

from deltaserve.cache import budget
from deltaserve.cache.budget import CacheLayout, plan_layout, size_layout, unit_bytes
from deltaserve.model.config import ModelConfig
from deltaserve.tiny import make_tiny

BF16, F32 = torch.bfloat16, torch.float32


@pytest.fixture(autouse=True)
def _no_meminfo(monkeypatch):
    """Every test sees RAM as in a host without /proc/meminfo (the figures are exact); the one
    about MemAvailable fakes it."""
    monkeypatch.setattr(budget, "available_bytes", lambda: None)


@pytest.fixture(scope="module")
def cfg(tmp_path_factory):
    return ModelConfig.from_pretrained(make_tiny(tmp_path_factory.mktemp("k3"), family="kimi_k3", seed=0))


def test_default_is_the_workload_cap_exactly(cfg, caplog):
    slot, page = unit_bytes(cfg, 16, BF16, F32)
    assert (slot, page) == (28032, 2560)  # 3 KDA layers, 2 MLA layers of latent 40: the tiny K3
    with caplog.at_level(logging.INFO, logger="deltaserve.cache.budget"):
        layout = size_layout(cfg, None, 16, 8192, 16, BF16)
    assert layout == CacheLayout(16, 16 * 512, 16, page, slot, BF16, F32, 0)
    assert layout.total_bytes == 16 * 512 * 2560 + 16 * 28032 == 21_420_032
    assert (
        "KV cache 20.4 MiB (default: what max_num_seqs=16 x max_model_len=8192 tokens can use, less "
        "than 10% of RAM" in caplog.text
    )


def test_default_with_prefix_caching_doubles_pages_and_adds_checkpoints(cfg):
    slot, page = unit_bytes(cfg, 16, BF16, F32)
    layout = size_layout(cfg, None, 4, 1000, 16, BF16, checkpoint_fraction=0.25)
    pages = 2 * 4 * 63
    live = pages * page + 4 * slot
    n_ckpt = -(-live // (3 * slot))  # checkpoints are 1/4 of the total: 1/3 of the rest
    assert layout == CacheLayout(16, pages, 4, page, slot, BF16, F32, n_ckpt) and n_ckpt == 17
    assert n_ckpt * slot >= layout.total_bytes / 4 > (n_ckpt - 1) * slot


def test_explicit_budget_is_unchanged(cfg):
    for given in (10**7, 5 * 2**30):
        assert size_layout(cfg, given, 16, 8192, 16, BF16) == plan_layout(cfg, given, 16, 8192, 16, BF16)
    big = size_layout(cfg, 5 * 2**30, 16, 8192, 16, BF16, checkpoint_fraction=0.25)
    assert big.total_bytes <= 5 * 2**30 < big.total_bytes + big.page_bytes


def test_explicit_fraction_is_of_ram(cfg, monkeypatch):
    monkeypatch.setattr(budget, "total_ram_bytes", lambda: 10**9)
    assert size_layout(cfg, 0.5, 2, 64, 16, BF16) == plan_layout(cfg, 5 * 10**8, 2, 64, 16, BF16)


def test_default_falls_back_to_the_ram_share_when_smaller(cfg, monkeypatch, caplog):
    monkeypatch.setattr(budget, "total_ram_bytes", lambda: 10**8)  # 10 % = 10 MB < 20.4 MiB
    with caplog.at_level(logging.INFO, logger="deltaserve.cache.budget"):
        layout = size_layout(cfg, None, 16, 8192, 16, BF16)
    assert layout == plan_layout(cfg, 10**7, 16, 8192, 16, BF16) and layout.num_pages < 16 * 512
    assert (
        "KV cache 9.5 MiB (default: 10% of RAM, less than the 20.4 MiB max_num_seqs=16 x "
        "max_model_len=8192 tokens can use)" in caplog.text
    )


def test_on_cuda_the_budget_is_device_memory(cfg, monkeypatch):
    """On a CUDA device the default is what is free after the weights less 10 % of the device, a
    fraction is of the device's memory, and too little left is a clear error (mem_get_info faked:
    no GPU here; nothing is allocated)."""
    gib = 2**30
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (gib, 2 * gib))
    want = gib - int(0.1 * 2 * gib)
    assert size_layout(cfg, None, 16, 2**20, 16, BF16, device="cuda") == plan_layout(cfg, want, 16, 2**20, 16, BF16)
    assert size_layout(cfg, 0.25, 2, 64, 16, BF16, device="cuda") == plan_layout(cfg, gib // 2, 2, 64, 16, BF16)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (gib // 4, 2 * gib))
    with pytest.raises(ValueError, match="left for the KV cache after the weights"):
        size_layout(cfg, None, 16, 2**20, 16, BF16, device="cuda")


def test_on_cpu_the_budget_fits_the_ram_available_after_the_weights(cfg, monkeypatch, caplog):
    """MemAvailable (faked) caps the default and refuses an explicit budget above it, before any
    pool is allocated (pools past it would be the kernel's to kill the process for)."""
    monkeypatch.setattr(budget, "total_ram_bytes", lambda: 10**9)  # 10 %: 100 MB, more than the tiny workload
    monkeypatch.setattr(budget, "available_bytes", lambda: 10**7)
    with caplog.at_level(logging.INFO, logger="deltaserve.cache.budget"):
        layout = size_layout(cfg, None, 16, 8192, 16, BF16)
    assert layout == plan_layout(cfg, 9 * 10**6, 16, 8192, 16, BF16)
    assert "default: 90% of the RAM available after the weights, less than the 20.4 MiB" in caplog.text
    assert size_layout(cfg, 10**7, 16, 8192, 16, BF16) == plan_layout(cfg, 10**7, 16, 8192, 16, BF16)
    for given in (2 * 10**7, 0.5):
        with pytest.raises(ValueError, match="available after the weights"):
            size_layout(cfg, given, 16, 8192, 16, BF16)
    monkeypatch.setattr(budget, "available_bytes", lambda: None)  # no /proc/meminfo: RAM as before
    assert size_layout(cfg, 0.5, 2, 64, 16, BF16) == plan_layout(cfg, 5 * 10**8, 2, 64, 16, BF16)


def test_checkpoints_never_take_the_pages_max_model_len_needs(cfg):
    """With prefix caching on by default, a budget that holds max_model_len tokens of pages but not
    the full checkpoint share gets fewer checkpoints (at least one), not a start-up error."""
    slot, page = unit_bytes(cfg, 16, BF16, F32)
    need = 8192 // 16
    budget_bytes = 16 * slot + need * page + 5 * slot + 100  # room for 5 checkpoints beside the pages
    layout = plan_layout(cfg, budget_bytes, 16, 8192, 16, BF16, checkpoint_fraction=0.25)
    assert (layout.num_checkpoint_slots, layout.num_pages) == (5, need)
    assert layout.total_bytes <= budget_bytes
    roomy = plan_layout(cfg, 10 * budget_bytes, 16, 8192, 16, BF16, checkpoint_fraction=0.25)
    assert roomy.num_checkpoint_slots == int(0.25 * 10 * budget_bytes) // slot  # the share, uncapped
