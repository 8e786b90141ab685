"""Request-time check that a JSON schema admits a finite JSON value (engine/request/structured.py), and
`rebase_refs`, which moves a schema's local `$ref`s with it when it is embedded in another.

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

import re
from urllib.parse import unquote

_PRIMITIVES = {"string", "number", "integer", "boolean", "null"}
_ALL_TYPES = _PRIMITIVES | {"object", "array"}
# keywords whose value is a schema, a list of schemas, or a map of names to schemas (2020-12 and
# draft-07); every other keyword's value is data (`const`, `enum`, `default`, ...) or unknown
_SUBSCHEMA = {
    "items", "additionalItems", "additionalProperties", "contains", "not", "if", "then", "else",
    "propertyNames", "unevaluatedItems", "unevaluatedProperties", "contentSchema",
}  # fmt: skip
_SCHEMA_LISTS = {"allOf", "anyOf", "oneOf", "prefixItems", "items"}
_SCHEMA_MAPS = {"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"}


def _slots(node: dict):
    """(container, key) of every sub-schema directly under `node` (maps and lists of schemas
    copied first, so a caller may replace what it finds)."""
    for key, value in list(node.items()):
        if key in _SCHEMA_LISTS and isinstance(value, list):
            node[key] = value = list(value)
            yield from ((value, i) for i in range(len(value)))
        elif key in _SCHEMA_MAPS and isinstance(value, dict):
            node[key] = value = dict(value)
            yield from ((value, k) for k in value)
        elif key in _SUBSCHEMA:
            yield node, key


def _copies(schema: dict):
    """Yields a copy of every sub-schema dict of `schema` (itself first), linked as in `schema`;
    the first one yielded is the copy's root. Iterative: any depth."""
    root = dict(schema)
    todo = [root]
    while todo:
        node = todo.pop()
        yield node
        for container, key in _slots(node):
            if isinstance(container[key], dict):
                container[key] = dict(container[key])
                todo.append(container[key])


def rebase_refs(schema, base: str):
    """A copy of `schema` for use at JSON pointer `base` (e.g. `#/items/anyOf/0`) of another
    document: every local `$ref` (`#` or `#/...`, resolved against the schema's own root) gets
    `base` in front, so `#/$defs/X` still names the schema's own `$defs` (and `definitions`)
    entry, and `#` the schema itself. Data keywords (`const`, `enum`, `default`, ...) are copied
    untouched; remote and anchor refs (`#name`) are left as they are."""
    if not isinstance(schema, dict):
        return schema
    nodes = _copies(schema)
    root = None
    for node in nodes:
        root = root or node
        ref = node.get("$ref")
        if isinstance(ref, str) and (ref == "#" or ref.startswith("#/")):
            node["$ref"] = base + ref[1:]
    return root


def patterns(schema) -> set[str]:
    """Every `pattern` string of `schema`'s sub-schemas (not of its data keywords)."""
    if not isinstance(schema, dict):
        return set()
    return {node["pattern"] for node in _copies(schema) if isinstance(node.get("pattern"), str)}


_COUNT = re.compile(r"\{(\d+)(?:,(\d*))?\}")


def pattern_size(pattern: str) -> int:
    """An upper estimate of how many single-character items `pattern` expands to: counted
    repetitions (`x{n}`, `x{m,n}`, nested ones multiplied) repeat what they follow, an
    escape or a character class is one item. Grammar engines expand counted repetitions, so
    this bounds their work."""
    stack = [[0, 0]]  # per open group: [its size so far, the size of its last item]
    i = 0
    while i < len(pattern):
        c, item = pattern[i], None
        if c == "\\":
            item, i = 1, i + 2
        elif c == "[":
            j = i + 1
            while j < len(pattern) and (pattern[j] != "]" or j == i + 1):
                j += 2 if pattern[j] == "\\" else 1
            item, i = 1, j + 1
        elif c == "(":
            stack.append([0, 0])
            i += 1
        elif c == ")" and len(stack) > 1:
            item, i = stack.pop()[0], i + 1
        elif c == "{" and (m := _COUNT.match(pattern, i)):
            top = stack[-1]
            n = max(int(m.group(1)), int(m.group(2) or 0))
            top[0] += top[1] * (n - 1)
            top[1] *= n
            i = m.end()
        else:
            item, i = (0 if c in "*+?|^$" else 1), i + 1
        if item is not None:
            stack[-1][0] += item
            stack[-1][1] = item
    return sum(s[0] for s in stack)


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
