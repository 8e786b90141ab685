"""Starting the ranks' transfer engines never leaves the ranks out of step: a rank whose engine
fails to start (here rank 0, with any exception) answers an error like the others answer their
endpoints, and the instance goes on stepping (the control group's gather is always paired)."""

from __future__ import annotations

from deltaserve.engine.exec import rank_transfer
from deltaserve.engine.request.sampling_params import SamplingParams

from .pd_fixtures import make_llm, need_mooncake, tp_checkpoint

need_mooncake()


def test_a_rank_whose_transfer_engine_fails_to_start_keeps_the_ranks_in_step(tmp_path, monkeypatch):
    with make_llm(tp_checkpoint(tmp_path), tensor_parallel_size=2) as llm:

        def broken(kind, host):
            raise RuntimeError("no transfer engine here")

        monkeypatch.setattr(rank_transfer, "make_connector", broken)  # this process: rank 0 only
        endpoints = rank_transfer.setup_transfer(llm.engine, "mooncake", "127.0.0.1")
        assert "RuntimeError: no transfer engine here" in endpoints[0].error
        assert not endpoints[1].error and endpoints[1].session
        out = llm.generate([{"prompt_token_ids": [5, 6, 7, 8]}], SamplingParams(max_tokens=3, temperature=0))
        assert len(out[0].outputs[0].token_ids) == 3
