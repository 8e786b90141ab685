"""The seam between model/ and the backends, read from the source: which backend methods may
answer None (their return annotation says so in `TorchOps`), and which of those model/ still
calls. A None reaching a layer would mean the layer runs its own math and knows which kernels
exist; the fallback belongs inside the backend (issue 38): a whole-plan method takes the layer's
path as `otherwise` and none of those model/ calls may answer None."""

from __future__ import annotations

import ast
from pathlib import Path

import deltaserve

ROOT = Path(deltaserve.__file__).parent
WHOLE_PLAN = {"decode_stack", "decode_logits", "kda_decode", "mla_block", "moe_block"}


def _torch_ops_methods() -> list[ast.FunctionDef]:
    tree = ast.parse((ROOT / "ops" / "backends" / "torch.py").read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "TorchOps")
    return [f for f in cls.body if isinstance(f, ast.FunctionDef)]


def _may_answer_none() -> set[str]:
    return {
        f.name
        for f in _torch_ops_methods()
        if f.returns is not None and "None" in ast.unparse(f.returns) and not f.name.startswith("prepare")
    }


def _called_from_model() -> set[str]:
    called = set()
    for path in (ROOT / "model").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                owner = node.func.value
                if isinstance(owner, ast.Attribute) and owner.attr == "ops":
                    called.add(node.func.attr)
    return called


def _takes_otherwise() -> set[str]:
    return {f.name for f in _torch_ops_methods() if "otherwise" in {a.arg for a in f.args.args}}


def test_model_receives_no_none_from_a_backend():
    may_none = _may_answer_none()
    assert {"mla_decode", "mla_extend", "mla_decode_partial"} <= may_none  # the backends' own hooks
    assert _called_from_model() & may_none == set()
    assert WHOLE_PLAN <= _called_from_model() and WHOLE_PLAN <= _takes_otherwise()
    assert {"mla_attend", "mla_dcp_partial", "lse_merge", "vision_attention"} <= _called_from_model()
