"""Every DELTASERVE_* environment variable is declared once in `deltaserve.env` and read through
it: no other module spells a name as a string, every name the code and docs mention is declared,
and `deltaserve env` lists them with the values set."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

import deltaserve
from deltaserve import env
from deltaserve.cli import main

ROOT = Path(deltaserve.__file__).parent
NAME = re.compile(r"DELTASERVE_[A-Z0-9_]*[A-Z0-9]")


def test_no_module_but_env_spells_a_variable():
    spelled = []
    for path in ROOT.rglob("*.py"):
        if path.name == "env.py" and path.parent == ROOT:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and NAME.fullmatch(node.value):
                spelled.append(f"{path.relative_to(ROOT)}: {node.value}")
    assert spelled == []


def test_every_mentioned_variable_is_declared():
    docs = ROOT.parents[1] / "docs"
    texts = [p.read_text() for p in [*ROOT.rglob("*.py"), *docs.glob("*.md"), ROOT.parents[1] / "README.md"]]
    mentioned = {m for text in texts for m in NAME.findall(text)}
    assert "DELTASERVE_HUGE_PAGES" in mentioned
    assert mentioned - set(env.SWITCHES) == set()


def test_switch_kinds(monkeypatch):
    assert env.AMX.on() and not env.TRITON_KERNELS.on()
    monkeypatch.setenv(env.AMX.name, "0")
    monkeypatch.setenv(env.TRITON_KERNELS.name, "1")
    assert not env.AMX.on() and env.TRITON_KERNELS.on()
    monkeypatch.setenv(env.AMX.name, "yes")  # anything but "0" leaves an "on" switch on
    assert env.AMX.on()
    with pytest.raises(TypeError):
        env.ISA.on()
    with pytest.raises(ValueError):
        env.declare("DELTASERVE_AMX", "on", "1", "twice")


def test_deltaserve_env_lists_them(monkeypatch, capsys):
    monkeypatch.setenv(env.ISA.name, "avx2")
    assert main(["env"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in lines] == list(env.SWITCHES)
    assert any(line.startswith("DELTASERVE_ISA") and "(now 'avx2')" in line for line in lines)
