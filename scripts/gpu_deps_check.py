"""Whether this interpreter (its own packages plus what `scripts/gpu_check.sh` installed from the
carried wheels, on `PYTHONPATH`) holds what deltaserve needs: every runtime dependency of
pyproject.toml at a version its range admits (exit 1 otherwise), the `gpu` extra reported (each
optional), and the server, the engine and the Triton backend importable.

    python3 scripts/gpu_deps_check.py
"""

from __future__ import annotations

import importlib
import sys
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import tomllib
from packaging.requirements import Requirement

ROOT = Path(__file__).parents[1]
MODULES = ("deltaserve.engine.llm", "deltaserve.server.app", "deltaserve.kernels.triton")


def verdict(req: Requirement) -> tuple[bool, str]:
    """(satisfied, one line) for one requirement."""
    try:
        have = version(req.name)
    except PackageNotFoundError:
        return False, f"{req.name}: missing (wants {req.specifier or 'any'})"
    ok = req.specifier.contains(have, prereleases=True)
    return ok, f"{req.name} {have}{'' if ok else f' (wants {req.specifier})'}"


def main() -> int:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    failures = 0
    for text in project["dependencies"]:
        ok, line = verdict(Requirement(text))
        failures += not ok
        print(("  " if ok else "  FAILED ") + line)
    for text in project["optional-dependencies"]["gpu"]:
        req = Requirement(text)
        if req.marker is None or req.marker.evaluate():
            print("  gpu extra: " + verdict(req)[1])
    for module in MODULES:
        try:
            importlib.import_module(module)
        except Exception as e:  # any import failure is the finding
            failures += 1
            print(f"  FAILED import {module}: {type(e).__name__}: {e}")
    print("deps:", "FAILED" if failures else "ok", f"(python {sys.version.split()[0]})")
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
