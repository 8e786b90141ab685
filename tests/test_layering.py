"""The house's layering, read from the source: no import cycles between modules, and every
floor imports only from the floors below it (LEVEL, bottom to top), lazy imports inside functions included. A module's
floor is that of the longest dotted prefix of its name listed in LEVEL (kernels.triton before
kernels), so a package can hold floors of its own: ops' reference functions sit below the GPU
kernels that reuse them (an LSE merge, the operand bundles), and the backends above both."""

from __future__ import annotations

import ast
from pathlib import Path

import deltaserve

ROOT = Path(deltaserve.__file__).parent
LEVEL = {
    "env": -1,  # the DELTASERVE_* variables, read by every floor
    "kernels": 0,  # cpu/, transfer, chunking
    "parallel": 0,
    "ops": 1,  # the pure-PyTorch reference ops and operand bundles
    "kernels.triton": 2,
    "kernels.extern": 2,
    "ops.backends": 3,
    "model": 4,
    "tiny": 5,
    "cache": 5,
    "chat": 5,
    "train": 5,  # the curriculum and trainer: model, tiny and chat, no engine
    # the engine's rooms, by lifecycle
    "engine": 6,  # engine/__init__.py
    "engine.config": 6,
    "engine.request": 7,
    "engine.sched": 8,
    "engine.exec": 9,
    "engine.spec": 10,
    "engine.core": 11,
    "engine.dp": 12,
    "engine.llm": 13,
    "server": 14,  # the HTTP layer
    "disagg": 15,  # builds on server's engine thread and errors
    # processes: the entry points beside cli.py, and the benches they run
    "serve": 16,
    "replica_front": 16,
    "roles": 16,
    "proxy": 16,
    "bench": 17,
    "evals": 17,  # `deltaserve eval`: the engine or a server on curriculum tasks
    "cli": 18,
    "__init__": 18,
}


def floor(module: str) -> str:
    """The LEVEL key a module belongs to (its longest listed prefix; its top package otherwise)."""
    parts = module.split(".")
    for i in range(len(parts), 0, -1):
        if ".".join(parts[:i]) in LEVEL:
            return ".".join(parts[:i])
    return parts[0]


def _modules() -> dict[str, Path]:
    out = {}
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts) or "__init__"] = path
    return out


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """Modules of this package that `name` imports (relative imports resolved)."""
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - (node.level - 1)] if node.level > 1 else package
                target = ".".join(base + ([node.module] if node.module else []))
            elif (node.module or "").startswith("deltaserve."):
                target = node.module.removeprefix("deltaserve.")
            else:
                continue
            for candidate in (target, *(f"{target}.{a.name}" if target else a.name for a in node.names)):
                if candidate in modules and candidate != name:
                    found.add(candidate)
    return found


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def _upward(graph: dict[str, set[str]]) -> list[str]:
    """Imports from a higher layer (a package missing from LEVEL counts as the highest)."""
    wrong = []
    for name, deps in graph.items():
        for dep in deps:
            here, there = floor(name), floor(dep)
            if here != there and LEVEL.get(there, 99) > LEVEL.get(here, -1):
                wrong.append(f"{name} -> {dep}")
    return wrong


def test_layers_import_downward_only():
    assert not _upward(_graph())


def _cycles(graph: dict[str, set[str]]) -> list[str]:
    """Import cycles (a package importing its own submodules through its __init__ excepted)."""
    state, cycles = {}, []

    def visit(node: str, stack: list[str]) -> None:
        state[node] = "open"
        stack.append(node)
        for dep in sorted(graph[node]):
            if state.get(dep) == "open":
                cycle = stack[stack.index(dep) :]
                if not all(dep.startswith(m) or m.startswith(dep) for m in cycle):  # a package's own __init__
                    cycles.append(" -> ".join([*cycle, dep]))
            elif dep not in state:
                visit(dep, stack)
        stack.pop()
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node, [])
    return cycles


def test_no_import_cycles():
    assert not _cycles(_graph())


def test_the_checks_can_fail():
    graph = _graph()
    assert "ops.operands" in graph["model.kda_layer"]  # relative imports are resolved
    graph["ops.backends.torch"] = graph["ops.backends.torch"] | {"model.kda_layer"}
    assert _upward(graph) == ["ops.backends.torch -> model.kda_layer"]
    assert _upward({"kernels.triton.mla": {"ops.backends.torch"}}) == ["kernels.triton.mla -> ops.backends.torch"]
    assert _cycles({"server.a": {"server.b"}, "server.b": {"server.a"}}) == ["server.a -> server.b -> server.a"]
