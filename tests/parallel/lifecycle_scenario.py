"""Tensor-parallel engines one after another in one process (`python -m
tests.parallel.lifecycle_scenario DIR`, run by test_tp_lifecycle.py under a deadline): each
generates what one process does, on both families, bf16-stored and MXFP4 experts, after `del`, a
failed start, `close()` and a `with` block; no worker outlives its engine; a second live engine
and a group the user initialised are refused. Prints LIFECYCLE OK at the end."""

from __future__ import annotations

import gc
import sys
from pathlib import Path

import pytest
import torch.distributed as dist

from deltaserve.engine.request.sampling_params import SamplingParams
from deltaserve.parallel import ProcessGroupTaken

from .engine_fixtures import make_llm, write_checkpoints

PROMPTS = [[5 + i for i in range(9)], [(7 * i) % 1900 + 30 for i in range(41)]]
GREEDY = SamplingParams(max_tokens=6, temperature=0)


def _children() -> list[int]:
    kids = []
    for task in Path("/proc/self/task").iterdir():
        kids += [int(x) for x in (task / "children").read_text().split()]
    return kids


def _tokens(llm) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


def main(root: Path) -> None:
    ckpts = write_checkpoints(root)
    want = {}
    for name, path in ckpts.items():
        with make_llm(path) as one:
            want[name] = _tokens(one)
    llm = make_llm(ckpts["k3"], tp=2)
    assert _tokens(llm) == want["k3"]
    del llm  # the last reference
    assert _children() == [], "a worker outlived its engine"
    with pytest.raises(ValueError):  # rank 0 fails after every rank loaded and joined
        make_llm(ckpts["k3"], tp=2, kv_cache_memory=1)
    assert _children() == [], "a failed start left a worker"
    llm = make_llm(ckpts["kl_mx"], tp=2)
    assert _tokens(llm) == want["kl_mx"]
    del llm
    llm = make_llm(ckpts["k3_mx"], tp=2)
    assert _tokens(llm) == want["k3_mx"]
    with pytest.raises(ProcessGroupTaken, match="still holds"):
        make_llm(ckpts["kl"], tp=2)
    llm.close()
    assert not dist.is_initialized() and _children() == []
    dist.init_process_group("gloo", init_method=f"file://{root}/user_store", rank=0, world_size=1)
    with pytest.raises(ProcessGroupTaken, match="not by deltaserve"):
        make_llm(ckpts["kl"], tp=2)
    dist.destroy_process_group()
    with make_llm(ckpts["kl"], tp=2) as llm:
        assert _tokens(llm) == want["kl"]
    gc.collect()
    assert not dist.is_initialized() and _children() == []
    print("LIFECYCLE OK", flush=True)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
