"""Two native builds side by side in one process (scripts/native_ab.py): `library.using` hands one
build to the engines made and run inside it and restores the process's own after; `library.load`
builds from another source directory; the script extracts a revision's sources and runs both modes
on a tiny checkpoint."""

from __future__ import annotations

import runpy
import shutil
import subprocess
from pathlib import Path

import pytest

from deltaserve.kernels.cpu import build
from deltaserve.kernels.cpu import library as cpu_kernels
from deltaserve.tiny import make_tiny

pytestmark = pytest.mark.skipif(
    build.find_compiler() is None or cpu_kernels.native() is None, reason="no native kernels"
)
SCRIPT = Path(__file__).parents[2] / "scripts" / "native_ab.py"


def test_using_routes_native_and_restores(tmp_path):
    own = cpu_kernels.native()
    shutil.copytree(build.CSRC, tmp_path / "csrc")
    (tmp_path / "csrc" / "zz_marker.c").write_text("int ds_ab_marker(void) { return 7; }\n")
    other = cpu_kernels.load(csrc=tmp_path / "csrc")  # another source set: another library file
    assert other.lib._name != own.lib._name and other.lib.ds_ab_marker() == 7
    with cpu_kernels.using(other):
        assert cpu_kernels.native() is other and cpu_kernels.native("cpu") is other
        assert cpu_kernels.native("meta") is None
    assert cpu_kernels.native() is own


def test_revision_sources_match_the_tree_at_head(tmp_path):
    if subprocess.run(["git", "-C", str(SCRIPT.parent), "rev-parse", "HEAD"], capture_output=True).returncode:
        pytest.skip("not a git checkout")
    ab = runpy.run_path(str(SCRIPT))
    got = ab["revision_sources"]("HEAD", tmp_path)
    head = subprocess.run(
        [
            "git",
            "-C",
            str(ab["ROOT"]),
            "ls-tree",
            "--name-only",
            "HEAD",
            build.CSRC.relative_to(ab["ROOT"]).as_posix() + "/",
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    assert sorted(p.name for p in got.iterdir()) == sorted(Path(p).name for p in head) and head


@pytest.mark.parametrize("mode", ["decode", "prefill"])
def test_script_runs_both_engines(tmp_path, capsys, mode):
    ckpt = make_tiny(tmp_path / "k3", "kimi_k3", seed=3)
    ab = runpy.run_path(str(SCRIPT))
    ab["main"](
        ["--model", str(ckpt), "--mode", mode, "--seqs", "2", "--prompt-len", "9", "--output-len", "3", "--rounds", "2"]
    )
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 3 and out[0].startswith("base (this tree): median") and "per round: median" in out[2]
    assert cpu_kernels.native() is not None and cpu_kernels._chosen is None
