"""The one declared ABI of the native CPU kernels, `csrc/ds_abi.h`, parsed at import.

From the header alone come the ctypes signatures (`declare`), the shared constants (`CONSTANTS`
and the names below), one ctypes.Structure per struct (`STRUCTS`) and the version (`VERSION`);
nothing here is a second copy of them. `check(lib)` refuses a library whose `ds_abi_version()`
or `ds_abi_sizeof(name)` disagrees with the parse (`AbiMismatch`; the loader then falls back to
the PyTorch paths). A header line outside the parseable subset (see the header's comment) raises
ValueError at import: that is a broken package, not a machine without the kernels.
"""

from __future__ import annotations

import ctypes
import re
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "ACT_SILU",
    "ACT_SITU",
    "AMX_ROWS",
    "CONSTANTS",
    "FUNCTIONS",
    "GATE_SIGMOID",
    "GATE_SOFTPLUS",
    "GROUP_SIZE",
    "HEADER",
    "KDA_MAX_CHUNK",
    "MAX_MIX",
    "MAX_MULTI",
    "MAX_ROWS",
    "MLA_MAX_HEADS",
    "MLA_MAX_RANK",
    "STRUCTS",
    "VERSION",
    "AbiMismatch",
    "Signature",
    "check",
    "declare",
    "parse",
]

HEADER = Path(__file__).with_name("csrc") / "ds_abi.h"

_SCALARS = {
    "void": None,
    "int": ctypes.c_int,
    "int64_t": ctypes.c_int64,
    "float": ctypes.c_float,
    "size_t": ctypes.c_size_t,
}
_POINTEES = {"void", "char", "int", "int64_t", "float", "uint8_t", "uint16_t"}


class AbiMismatch(RuntimeError):
    """The loaded library is not the one the header describes."""


@dataclass(frozen=True)
class Signature:
    """One prototype: `restype(*argtypes)`; the C spelling of each type (`c_restype`, `c_types`,
    e.g. `const uint16_t *const *`) and the argument names are kept for messages and tests."""

    restype: type | None
    argtypes: tuple
    names: tuple[str, ...]
    c_restype: str
    c_types: tuple[str, ...]


def _strip(text: str) -> str:
    text = re.sub(r"/\*.*?\*/", " ", text, flags=re.S)
    return re.sub(r"//[^\n]*", " ", text)


def _unqualified(c_type: str) -> str:
    return re.sub(r"\bconst\b", "", c_type).strip()


def _decl(text: str, structs: dict) -> tuple[object, str, str]:
    """(ctypes type, name, C type) of one named declaration such as `const uint16_t *const *xs`."""
    m = re.fullmatch(r"((?:const\s+)?\w+)(\s+|(?:\s*\*\s*(?:const\b)?)+\s*)(\w+)", text.strip())
    if m is None:
        raise ValueError(f"ds_abi.h: cannot parse declaration {text.strip()!r} (named, scalar or pointer)")
    base, stars, name = _unqualified(m.group(1)), m.group(2).count("*"), m.group(3)
    spelled = " ".join((m.group(1) + m.group(2)).replace("*", " * ").split())
    if stars == 0:
        if base not in _SCALARS or _SCALARS[base] is None:
            raise ValueError(f"ds_abi.h: unsupported scalar type {base!r} of {name}")
        return _SCALARS[base], name, spelled
    if stars == 1 and base in structs:
        return ctypes.POINTER(structs[base]), name, spelled
    if base not in _POINTEES and base not in structs:
        raise ValueError(f"ds_abi.h: unsupported pointer type {base!r} of {name}")
    return ctypes.c_void_p, name, spelled


def _struct(name: str, body: str, structs: dict) -> type:
    fields = []
    for decl in filter(None, (d.strip() for d in body.split(";"))):
        head, *more = decl.split(",")
        m = re.fullmatch(r"((?:const\s+)?\w+)\s*(.*)", head.strip(), flags=re.S)
        if m is None:
            raise ValueError(f"ds_abi.h: cannot parse field {decl!r} of {name}")
        for declarator in (m.group(2), *more):
            ctype, field, _ = _decl(f"{m.group(1)} {declarator}", structs)
            fields.append((field, ctype))
    return type(name, (ctypes.Structure,), {"_fields_": fields, "__doc__": f"`{name}` of ds_abi.h, field for field."})


def _function(stmt: str, structs: dict) -> tuple[str, Signature]:
    m = re.fullmatch(r"(.+?)\b(ds_\w+)\s*\((.*)\)", stmt, flags=re.S)
    if m is None:
        raise ValueError(f"ds_abi.h: cannot parse {stmt!r}")
    ret = _unqualified(m.group(1))
    if ret not in _SCALARS:
        raise ValueError(f"ds_abi.h: unsupported return type {ret!r} of {m.group(2)}")
    params = m.group(3).strip()
    decls = [] if params == "void" else [_decl(p, structs) for p in params.split(",")]
    argtypes, names, c_types = (tuple(col) for col in zip(*decls)) if decls else ((), (), ())
    return m.group(2), Signature(_SCALARS[ret], argtypes, names, ret, c_types)


def parse(text: str) -> tuple[int, dict[str, int], dict[str, type], dict[str, Signature]]:
    """(version, constants, structs, functions) declared by the header text `text`."""
    text = _strip(text)
    constants = {}
    for line in text.splitlines():
        line = line.strip()
        if re.match(r"#\s*(if|ifdef|elif|else|undef)\b", line):
            raise ValueError(f"ds_abi.h: no conditional compilation allowed ({line!r})")
        m = re.match(r"#\s*define\s+(DS_\w+)\b(.*)", line)
        if m:
            if not re.fullmatch(r"\s*-?\d+\s*", m.group(2)):
                raise ValueError(f"ds_abi.h: {m.group(1)} must be a decimal integer")
            constants[m.group(1)] = int(m.group(2))
    body = "\n".join(line for line in text.splitlines() if not line.strip().startswith("#"))
    structs: dict[str, type] = {}

    def take_struct(m: re.Match) -> str:
        structs[m.group(2)] = _struct(m.group(2), m.group(1), structs)
        return ""

    body = re.sub(r"typedef\s+struct\s*\{(.*?)\}\s*(\w+)\s*;", take_struct, body, flags=re.S)
    functions = dict(_function(" ".join(s.split()), structs) for s in body.split(";") if s.strip())
    if "DS_ABI_VERSION" not in constants:
        raise ValueError("ds_abi.h: DS_ABI_VERSION missing")
    return constants.pop("DS_ABI_VERSION"), constants, structs, functions


VERSION, CONSTANTS, STRUCTS, FUNCTIONS = parse(HEADER.read_text())

MAX_ROWS = CONSTANTS["DS_MAX_M"]
AMX_ROWS = CONSTANTS["DS_AMX_ROWS"]
GROUP_SIZE = CONSTANTS["DS_GROUP"]
MAX_MULTI = CONSTANTS["DS_MAX_MULTI"]
MAX_MIX = CONSTANTS["DS_MAX_MIX"]
MLA_MAX_HEADS = CONSTANTS["DS_MLA_MAX_HEADS"]
MLA_MAX_RANK = CONSTANTS["DS_MLA_MAX_RANK"]
KDA_MAX_CHUNK = CONSTANTS["DS_KDA_MAX_CHUNK"]
ACT_SILU, ACT_SITU = CONSTANTS["DS_ACT_SILU"], CONSTANTS["DS_ACT_SITU"]
GATE_SIGMOID, GATE_SOFTPLUS = CONSTANTS["DS_GATE_SIGMOID"], CONSTANTS["DS_GATE_SOFTPLUS"]


def declare(lib: ctypes.CDLL) -> None:
    """Set argtypes/restype of every function the header declares; AbiMismatch if one is missing."""
    for name, sig in FUNCTIONS.items():
        try:
            fn = getattr(lib, name)
        except AttributeError:
            raise AbiMismatch(f"the library lacks {name}") from None
        fn.argtypes, fn.restype = list(sig.argtypes), sig.restype


def check(lib: ctypes.CDLL) -> None:
    """AbiMismatch unless the declared library reports this header's version and struct sizes."""
    got = lib.ds_abi_version()
    if got != VERSION:
        raise AbiMismatch(f"library ABI version {got}, header {VERSION}")
    for name, struct in STRUCTS.items():
        size = lib.ds_abi_sizeof(name.encode())
        if size != ctypes.sizeof(struct):
            raise AbiMismatch(f"sizeof({name}) is {size} in the library, {ctypes.sizeof(struct)} here")
