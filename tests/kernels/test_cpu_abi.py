"""The declared ABI (kernels/cpu/csrc/ds_abi.h) against the compiler and the built library: the
parse agrees with what the C compiler reads from the header (constants, struct layouts, function
types), the library exports every declared function (and nothing undeclared), and a library that
fails the version or size check, or lacks a function, is refused in favour of the PyTorch paths."""

import ctypes
import functools
import logging
import re
import shutil
import subprocess

import pytest

from deltaserve.kernels.cpu import abi
from deltaserve.kernels.cpu import library as cpu_kernels
from deltaserve.kernels.cpu.build import CSRC, find_compiler

NK = cpu_kernels.native()
_C_SCALARS = {ctypes.c_int: "int", ctypes.c_int64: "int64_t", ctypes.c_float: "float", ctypes.c_size_t: "size_t"}


def _c_type(ctype, spelled: str) -> str:
    """The C type a parsed argument stands for: scalars from the parse's ctypes type (so a wrong
    mapping shows), pointers as spelled."""
    return _C_SCALARS[ctype] if ctype in _C_SCALARS else spelled


def _probe_source() -> str:
    lines = ["#include <stddef.h>", "#include <stdio.h>", '#include "ds_abi.h"', "int main(void) {"]
    for name in abi.CONSTANTS:
        lines.append(f'    printf("const {name} %lld\\n", (long long){name});')
    lines.append('    printf("const DS_ABI_VERSION %lld\\n", (long long)DS_ABI_VERSION);')
    for struct, cls in abi.STRUCTS.items():
        lines.append(f'    printf("sizeof {struct} %zu\\n", sizeof({struct}));')
        for field, _ in cls._fields_:
            lines.append(f'    printf("offsetof {struct}.{field} %zu\\n", offsetof({struct}, {field}));')
    for fn, sig in abi.FUNCTIONS.items():
        ret = "void" if sig.restype is None else _C_SCALARS[sig.restype]
        params = ", ".join(_c_type(t, s) for t, s in zip(sig.argtypes, sig.c_types)) or "void"
        lines.append(
            f"    _Static_assert(__builtin_types_compatible_p(__typeof__(&{fn}), {ret} (*)({params})), "
            f'"{fn}: the parse disagrees with the header");'
        )
    return "\n".join([*lines, "    return 0;", "}", ""])


@pytest.mark.skipif(find_compiler() is None, reason="no C compiler")
def test_parse_agrees_with_the_compiler(tmp_path):
    src, exe = tmp_path / "probe.c", tmp_path / "probe"
    src.write_text(_probe_source())
    subprocess.run(
        [find_compiler(), "-std=gnu11", "-Wall", "-Werror", f"-I{CSRC}", str(src), "-o", str(exe)],
        check=True,
        capture_output=True,
        text=True,
    )
    seen = dict(
        line.rsplit(" ", 1)
        for line in subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout.splitlines()
    )
    want = {f"const {k}": v for k, v in {**abi.CONSTANTS, "DS_ABI_VERSION": abi.VERSION}.items()}
    for struct, cls in abi.STRUCTS.items():
        want[f"sizeof {struct}"] = ctypes.sizeof(cls)
        want.update({f"offsetof {struct}.{f}": getattr(cls, f).offset for f, _ in cls._fields_})
    assert {k: int(v) for k, v in seen.items()} == want


def test_constants_and_plans_come_from_the_header():
    assert (cpu_kernels.MAX_ROWS, cpu_kernels.AMX_ROWS, cpu_kernels.GROUP_SIZE) == (
        abi.CONSTANTS["DS_MAX_M"],
        abi.CONSTANTS["DS_AMX_ROWS"],
        abi.CONSTANTS["DS_GROUP"],
    )
    assert cpu_kernels.NativeKernels.MAX_MULTI == abi.CONSTANTS["DS_MAX_MULTI"]
    assert cpu_kernels.NativeKernels.MAX_MIX == abi.CONSTANTS["DS_MAX_MIX"]
    from deltaserve.kernels.cpu import blocks

    assert blocks.MoeBlockPlan is abi.STRUCTS["ds_moe_block_t"]


@pytest.mark.skipif(NK is None, reason="native CPU kernels unavailable")
def test_library_exports_exactly_the_declared_functions():
    for name, sig in abi.FUNCTIONS.items():
        fn = getattr(NK.lib, name)
        assert (tuple(fn.argtypes), fn.restype) == (sig.argtypes, sig.restype), name
    assert NK.lib.ds_abi_version() == abi.VERSION
    assert all(NK.lib.ds_abi_sizeof(n.encode()) == ctypes.sizeof(s) for n, s in abi.STRUCTS.items())
    assert NK.lib.ds_abi_sizeof(b"no_such_struct") == 0
    if shutil.which("nm") is None:
        pytest.skip("no nm to list the library's symbols")
    listing = subprocess.run(
        ["nm", "-D", "--defined-only", NK.lib._name], check=True, capture_output=True, text=True
    ).stdout
    exported = {m.group(1) for m in re.finditer(r" T (ds_\w+)$", listing, flags=re.M)}
    internal = {
        m.group(1)
        for h in CSRC.glob("*.h")
        if h.name != abi.HEADER.name
        for m in re.finditer(r"\b(ds_\w+)\s*\(", h.read_text())
    }
    assert set(abi.FUNCTIONS) <= exported
    assert exported - set(abi.FUNCTIONS) <= internal, "exported kernels must be declared in ds_abi.h"


def _fresh_load(monkeypatch):
    fresh = functools.lru_cache(maxsize=1)(cpu_kernels._load.__wrapped__)
    monkeypatch.setattr(cpu_kernels, "_load", fresh)


class _Other(ctypes.Structure):
    _fields_ = [("x", ctypes.c_int)]


@pytest.mark.skipif(NK is None, reason="native CPU kernels unavailable")
@pytest.mark.parametrize("break_abi", ["version", "struct", "symbol"])
def test_a_mismatched_library_is_refused(monkeypatch, caplog, break_abi):
    if break_abi == "version":
        monkeypatch.setattr(abi, "VERSION", abi.VERSION + 1)
    elif break_abi == "struct":
        monkeypatch.setitem(abi.STRUCTS, "ds_moe_block_t", _Other)
    else:
        monkeypatch.setitem(abi.FUNCTIONS, "ds_not_built", abi.FUNCTIONS["ds_init"])
    _fresh_load(monkeypatch)
    with caplog.at_level(logging.WARNING, logger="deltaserve.kernels.cpu.library"):
        assert cpu_kernels.native() is None
    assert "refused" in caplog.text and "PyTorch" in caplog.text
    assert cpu_kernels.is_loaded()


@pytest.mark.parametrize(
    "header, message",
    [
        ("#define DS_X 1\n", "DS_ABI_VERSION missing"),
        ("#define DS_ABI_VERSION 1\n#define DS_X (1 + 1)\n", "decimal integer"),
        ("#define DS_ABI_VERSION 1\n#ifdef X\nint ds_f(void);\n#endif\n", "conditional"),
        ("#define DS_ABI_VERSION 1\nint ds_f(int);\n", "cannot parse declaration"),
        ("#define DS_ABI_VERSION 1\nint ds_f(double x);\n", "unsupported scalar"),
        ("#define DS_ABI_VERSION 1\ntypedef struct { int a[4]; } ds_s_t;\n", "cannot parse declaration"),
    ],
)
def test_the_parser_refuses_what_it_does_not_understand(header, message):
    with pytest.raises(ValueError, match=message):
        abi.parse(header)


def test_the_parser_reads_structs_and_prototypes():
    version, consts, structs, fns = abi.parse(
        "/* c */\n#define DS_ABI_VERSION 7\n#define DS_N -3 // n\n"
        "typedef struct { int a, b; float c; const uint16_t *p, *q; } ds_s_t;\n"
        "int64_t ds_f(const ds_s_t *s, const uint16_t *const *xs,\n  int64_t n, float x);\nvoid ds_g(void);\n"
    )
    assert (version, consts) == (7, {"DS_N": -3})
    assert [f for f, _ in structs["ds_s_t"]._fields_] == ["a", "b", "c", "p", "q"]
    assert ctypes.sizeof(structs["ds_s_t"]) == 32
    f = fns["ds_f"]
    assert f.restype is ctypes.c_int64 and f.names == ("s", "xs", "n", "x")
    assert f.argtypes[1:] == (ctypes.c_void_p, ctypes.c_int64, ctypes.c_float)
    assert f.argtypes[0]._type_ is structs["ds_s_t"]
    assert fns["ds_g"].argtypes == () and fns["ds_g"].restype is None
