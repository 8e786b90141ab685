"""Request-time check that a JSON schema admits a finite JSON value (engine/request/structured.py).

llguidance compiles schemas whose only instances are infinitely deep (a required property that
`$ref`s its own object, a `$ref` cycle), and decoding then runs until max_tokens without ever
completing. `no_finite_instance(schema)` finds them with a least-fixpoint "productive" analysis
over the schema graph (local `$ref`s resolved as JSON pointers), as for context-free grammars.

Invariant: the analysis over-approximates which sub-schemas have finite instances (anything it
does not model, e.g. `not`, `if`, unknown keywords, is taken as satisfiable), so a schema it
reports really has no finite instance; schemas that are unsatisfiable for other reasons
(`minimum > maximum`, conflicting types) are left to llguidance's own checks.
"""

from __future__ import annotations

from urllib.parse import unquote

_PRIMITIVES = {"string", "number", "integer", "boolean", "null"}
_ALL_TYPES = _PRIMITIVES | {"object", "array"}


def _pointer(root, ref: str):
    """The sub-schema a local `$ref` names, or None (remote or dangling: llguidance reports it)."""
    if not ref.startswith("#"):
        return None
    node = root
    for part in [p for p in ref[1:].split("/") if p]:
        part = unquote(part).replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node


def _children(node) -> list:
    """The dicts (and boolean schemas) directly under `node`: values and list items."""
    out = []
    for v in node.values():
        if isinstance(v, dict):
            out.append(v)
        elif isinstance(v, list):
            out.extend(x for x in v if isinstance(x, (dict, bool)))
    return out


class _Graph:
    def __init__(self, root):
        self.root = root
        self.nodes: dict[int, object] = {}
        stack = [root]
        while stack:
            node = stack.pop()
            if isinstance(node, dict) and id(node) not in self.nodes:
                self.nodes[id(node)] = node
                stack.extend(_children(node))
                ref = node.get("$ref")
                if isinstance(ref, str):
                    target = _pointer(root, ref)
                    if isinstance(target, dict):
                        stack.append(target)

    def ok(self, node, good: set[int]) -> bool:
        """Is `node` productive, given the productive dict nodes `good`?"""
        if isinstance(node, bool) or not isinstance(node, dict):
            return node is not False
        if id(node) in good:
            return True
        ref = node.get("$ref")
        if isinstance(ref, str):
            target = _pointer(self.root, ref)
            if target is not None and not self.ok_ref(target, good):
                return False
        if isinstance(node.get("allOf"), list) and not all(self.ok_ref(s, good) for s in node["allOf"]):
            return False
        for key in ("anyOf", "oneOf"):
            if isinstance(node.get(key), list) and node[key] and not any(self.ok_ref(s, good) for s in node[key]):
                return False
        if "const" in node or "enum" in node:
            return True
        types = node.get("type", list(_ALL_TYPES))
        types = {types} if isinstance(types, str) else set(types) if isinstance(types, list) else _ALL_TYPES
        if types & _PRIMITIVES or not types & _ALL_TYPES:
            return True
        return ("object" in types and self._object_ok(node, good)) or ("array" in types and self._array_ok(node, good))

    def ok_ref(self, node, good: set[int]) -> bool:
        return node is not False and (not isinstance(node, dict) or id(node) in good)

    def _object_ok(self, node, good) -> bool:
        props = node.get("properties") if isinstance(node.get("properties"), dict) else {}
        extra = node.get("additionalProperties", True)
        for name in node.get("required") or []:
            schema = props.get(name, extra) if isinstance(name, str) else True
            if not self.ok_ref(schema, good):
                return False
        return True

    def _array_ok(self, node, good) -> bool:
        min_items = node.get("minItems", 0)
        if not isinstance(min_items, int) or min_items <= 0:
            return True
        prefix = node.get("prefixItems") if isinstance(node.get("prefixItems"), list) else []
        if not all(self.ok_ref(s, good) for s in prefix[:min_items]):
            return False
        return min_items <= len(prefix) or self.ok_ref(node.get("items", True), good)


def no_finite_instance(schema: dict) -> bool:
    """True when no finite JSON value matches `schema` (see module invariant)."""
    graph = _Graph(schema)
    good: set[int] = set()
    changed = True
    while changed:
        changed = False
        for key, node in graph.nodes.items():
            if key not in good and graph.ok(node, good):
                good.add(key)
                changed = True
    return id(schema) not in good
