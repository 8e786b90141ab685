"""Starting the ranks' transfer engines never leaves the ranks out of step: a rank whose engine
fails to start (here rank 0, with any exception) answers an error like the others answer their
endpoints, and the instance goes on stepping (the control group's gather is always paired)."""

from __future__ import annotations

import pytest

from deltaserve.engine.exec import rank_transfer
from deltaserve.engine.request.sampling_params import SamplingParams

from .pd_fixtures import make_llm, need_mooncake, tp_checkpoint

need_mooncake()


def test_a_rank_whose_transfer_engine_fails_to_start_keeps_the_ranks_in_step(tmp_path, monkeypatch):
    with make_llm(tp_checkpoint(tmp_path), tensor_parallel_size=2) as llm:

        def broken(kind, host, protocol):
            raise RuntimeError("no transfer engine here")

        monkeypatch.setattr(rank_transfer, "make_connector", broken)  # this process: rank 0 only
        endpoints = rank_transfer.setup_transfer(llm.engine, "mooncake", "127.0.0.1")
        assert "RuntimeError: no transfer engine here" in endpoints[0].error
        assert not endpoints[1].error and endpoints[1].session
        out = llm.generate([{"prompt_token_ids": [5, 6, 7, 8]}], SamplingParams(max_tokens=3, temperature=0))
        assert len(out[0].outputs[0].token_ids) == 3


class _RecordingEngine:
    """Mooncake's `TransferEngine`, recording what it was started with."""

    started: list[tuple] = []

    def initialize(self, host, metadata, protocol, device):
        self.started.append((host, metadata, protocol, device))
        return 0

    def get_rpc_port(self):
        return 4242


def test_the_protocol_reaches_mooncake_and_rdma_needs_a_device(tmp_path, monkeypatch):
    import mooncake.engine

    from deltaserve.parallel import kv_transfer

    monkeypatch.setattr(mooncake.engine, "TransferEngine", _RecordingEngine)
    monkeypatch.setattr(kv_transfer, "RDMA_SYSFS", str(tmp_path / "absent"))
    with pytest.raises(kv_transfer.TransferError, match="rdma needs an RDMA device.*--kv-transfer-protocol tcp"):
        kv_transfer.make_connector("mooncake", "127.0.0.1", "rdma")
    assert _RecordingEngine.started == []  # refused before Mooncake starts
    with pytest.raises(ValueError, match="unknown KV transfer protocol"):
        kv_transfer.make_connector("mooncake", "127.0.0.1", "udp")
    (tmp_path / "ib" / "mlx5_0").mkdir(parents=True)
    monkeypatch.setattr(kv_transfer, "RDMA_SYSFS", str(tmp_path / "ib"))
    assert kv_transfer.rdma_devices() == ["mlx5_0"]
    for protocol in ("tcp", "rdma"):
        assert kv_transfer.make_connector("mooncake", "10.0.0.1", protocol).session == "10.0.0.1:4242"
    assert _RecordingEngine.started == [("10.0.0.1", "P2PHANDSHAKE", p, "") for p in ("tcp", "rdma")]


def test_every_rank_refuses_rdma_without_a_device_and_tcp_still_starts(tmp_path):
    from deltaserve.parallel.kv_transfer import rdma_devices

    if rdma_devices():
        pytest.skip("this machine has an RDMA device")
    with make_llm(tp_checkpoint(tmp_path), tensor_parallel_size=2) as llm:
        refused = rank_transfer.setup_transfer(llm.engine, "mooncake", "127.0.0.1", "rdma")
        assert all("rdma needs an RDMA device" in e.error for e in refused), refused
        started = rank_transfer.setup_transfer(llm.engine, "mooncake", "127.0.0.1", "tcp")
        assert not any(e.error for e in started) and len({e.session for e in started}) == 2


def test_serve_refuses_rdma_before_loading_the_model():
    import argparse

    from deltaserve.parallel.kv_transfer import rdma_devices
    from deltaserve.roles import check_role_arguments

    from .pd_fixtures import role_args

    if rdma_devices():
        pytest.skip("this machine has an RDMA device")
    args = role_args("decode", "--kv-transfer-protocol", "rdma")
    args = argparse.Namespace(**vars(args), decode_context_parallel_size=1, data_parallel_size=1)
    with pytest.raises(SystemExit, match="--role decode: --kv-transfer-protocol rdma needs an RDMA device"):
        check_role_arguments(args)
