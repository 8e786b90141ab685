"""`deltaserve bench pd` end to end on a tiny checkpoint: colocated and 1 prefill + 1 decode
instance (real processes behind the proxy) answer alike, handoffs happened and moved bytes,
and later turns hit the decode side's cache."""

from __future__ import annotations

import argparse
import re

from deltaserve.bench import pd
from deltaserve.tiny import make_tiny
from tests.disagg.pd_fixtures import need_mooncake


def test_bench_pd_runs_both_configurations(tmp_path, capsys):
    need_mooncake()
    ckpt = make_tiny(tmp_path / "k3", family="kimi_k3", preset="tiny", seed=2)
    p = argparse.ArgumentParser()
    pd.add_parser(p.add_subparsers())
    flags = "--sessions 2 --rounds 2 --system-tokens 64 --max-tokens 4 --threads 1 --dtype float32 --seed 1"
    args = p.parse_args(["pd", "--model", str(ckpt), *flags.split()])
    assert pd.main(args) == 0
    out = capsys.readouterr().out
    assert "greedy answers equal: 4/4" in out
    handoffs, gb = re.search(r"handoffs (\d+) \| moved ([0-9.]+) GB", out).groups()
    assert int(handoffs) == 4 and float(gb) > 0
    assert int(re.search(r"decode side's cache held (\d+) not transferred", out).group(1)) > 0
    once, every = map(int, re.search(r"\(1 rank\): (\d+) with .* (\d+) with every rank", out).groups())
    assert once == every > 0  # one rank: nothing to share


def test_read_bytes_counts_the_mla_rows_once_per_instance():
    state = {"bytes_mla": 1000, "bytes_kda": 300, "bytes_mla_shared": 3000}  # four ranks
    line = pd.read_bytes(state, 4)
    assert "(4 ranks): 1300 with the MLA rows read once" in line and "4300 with every rank" in line
