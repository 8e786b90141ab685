"""No pickle anywhere in deltaserve: no module that pickles is imported, no torch.distributed
object collective (they pickle) or `torch.load` is called, nothing passes `allow_pickle=True`.
Checked on the syntax tree of every source file (docstrings may say the words)."""

from __future__ import annotations

import ast
from pathlib import Path

import deltaserve

PICKLING_MODULES = {"pickle", "cPickle", "_pickle", "dill", "cloudpickle", "marshal", "shelve", "copyreg"}
PICKLING_MODULES |= {"multiprocessing", "torch.multiprocessing"}  # their queues and spawn args pickle
OBJECT_COLLECTIVES = {
    "broadcast_object_list",
    "all_gather_object",
    "gather_object",
    "scatter_object_list",
    "send_object_list",
    "recv_object_list",
}


def violations(source: str, name: str = "<src>") -> list[str]:
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            mods = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            mods = [node.module or ""] + [f"{node.module}.{a.name}" for a in node.names]
        else:
            mods = []
        found += [f"{name}:{node.lineno} imports {m}" for m in mods if m in PICKLING_MODULES]
        if isinstance(node, ast.Attribute):
            if node.attr in OBJECT_COLLECTIVES:
                found.append(f"{name}:{node.lineno} calls {node.attr}")
            if node.attr == "load" and isinstance(node.value, ast.Name) and node.value.id == "torch":
                found.append(f"{name}:{node.lineno} calls torch.load")
        if isinstance(node, ast.keyword) and node.arg == "allow_pickle":
            found.append(f"{name}:{node.value.lineno} passes allow_pickle")
    return found


def test_no_pickle_in_the_package():
    root = Path(deltaserve.__file__).parent
    files = sorted(root.rglob("*.py"))
    assert len(files) > 50
    bad = [v for f in files for v in violations(f.read_text(), str(f.relative_to(root)))]
    assert bad == []


def test_the_check_sees_each_kind_of_pickling():
    src = (
        "import pickle\nfrom multiprocessing import Queue\nimport torch.distributed as dist\n"
        "dist.broadcast_object_list([1])\nimport torch\ntorch.load('x')\nimport numpy as np\n"
        "np.load('x', allow_pickle=True)\n"
    )
    assert len(violations(src)) == 5


def test_the_data_parallel_protocol_is_among_the_checked_files():
    """The offline LLM's replicas are subprocesses over a socket of msgspec frames: no
    multiprocessing (its spawn arguments and queues pickle) in any of its modules."""
    engine = Path(deltaserve.__file__).parent / "engine"
    for name in ("dp/client.py", "dp/replica.py", "dp/protocol.py", "dp/routing.py", "llm.py"):
        source = (engine / name).read_text()
        assert violations(source, name) == []
        assert "send_object" not in source and "Queue(" not in source
