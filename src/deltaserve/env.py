"""Every `DELTASERVE_*` environment variable, declared once: name, kind, default and help.

Code reads a variable only through its `Switch` here (`HUGE_PAGES.on()`, `ISA.get()`), at the
moment it used to read `os.environ`, so setting one between calls still takes effect; writers
spell its name as `Switch.name`. `deltaserve env` lists them (`listing()`). Kinds:
- "on": on unless set to "0"; "off": off unless set to "1";
- "text": a value, or the default when unset (None: absent);
- "internal": set by deltaserve for the processes it starts (ranks, replicas), not by users.
The bottom floor of the house: imports nothing of deltaserve.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

KINDS = ("on", "off", "text", "internal")


@dataclass(frozen=True)
class Switch:
    name: str
    kind: str
    default: str | None
    help: str

    def get(self) -> str | None:
        """The raw value, or the default where unset."""
        return os.environ.get(self.name, self.default)

    def on(self) -> bool:
        """An "on" switch is on unless "0"; an "off" switch is on only when "1"."""
        if self.kind == "on":
            return os.environ.get(self.name, "1") != "0"
        if self.kind == "off":
            return os.environ.get(self.name, "0") == "1"
        raise TypeError(f"{self.name} is a {self.kind} variable, not a switch")

    def pop(self) -> str | None:
        """Read and remove (the internal hand-offs a child consumes once)."""
        return os.environ.pop(self.name, None)


SWITCHES: dict[str, Switch] = {}


def declare(name: str, kind: str, default: str | None, help: str) -> Switch:
    if not name.startswith("DELTASERVE_") or name in SWITCHES or kind not in KINDS:
        raise ValueError(f"bad declaration of {name} ({kind})")
    SWITCHES[name] = switch = Switch(name, kind, default, help)
    return switch


# kernels and backends
NATIVE = declare(
    "DELTASERVE_NATIVE", "on", "1", "the native CPU kernels for bf16 models on CPU (0: the PyTorch reference)"
)
ISA = declare("DELTASERVE_ISA", "text", None, "the CPU kernels' instruction set (default: the best this CPU has)")
AMX = declare("DELTASERVE_AMX", "on", "1", "AMX tile kernels where the CPU grants them")
CACHE = declare("DELTASERVE_CACHE", "text", None, "where native builds are cached (default ~/.cache/deltaserve)")
DECODE_STACK = declare(
    "DELTASERVE_DECODE_STACK", "on", "1", "a whole decode step in one native call (0: layer by layer)"
)
FLASH_PREFILL = declare("DELTASERVE_FLASH_PREFILL", "on", "1", "the native flash MLA prefill kernel (0: SDPA)")
TRITON = declare("DELTASERVE_TRITON", "text", "", "1: the Triton backend on any device; 0: never; unset: on CUDA")
FLA = declare("DELTASERVE_FLA", "on", "1", "fla-core's chunked KDA kernel where it imports and fits")
TORCH_FLASH = declare("DELTASERVE_TORCH_FLASH", "on", "1", "torch's flash varlen attention for MLA prefill")
FLASHINFER = declare("DELTASERVE_FLASHINFER", "on", "1", "FlashInfer's MLA decode where it imports and fits")
TRITON_KERNELS = declare("DELTASERVE_TRITON_KERNELS", "off", "0", "1: triton_kernels' MXFP4 MoE (opt-in)")
# model loading
HUGE_PAGES = declare("DELTASERVE_HUGE_PAGES", "on", "1", "move loaded CPU weights into one huge-page arena")
# serving
API_KEY = declare("DELTASERVE_API_KEY", "text", None, "the default of --api-key (serve, proxy)")
DISAGG_SECRET = declare("DELTASERVE_DISAGG_SECRET", "text", None, "the prefill/decode shared secret (default: a file)")
KV_TRANSFER_HOST = declare(
    "DELTASERVE_KV_TRANSFER_HOST", "internal", None, "the address a node's ranks advertise (serve --role)"
)
# hand-offs to child processes
WORKER = declare("DELTASERVE_WORKER", "internal", None, "a tensor-parallel worker's spec (JSON)")
DP_REPLICA = declare("DELTASERVE_DP_REPLICA", "internal", None, "a data-parallel replica's spec (JSON)")
EXIT_WITH_PARENT = declare("DELTASERVE_EXIT_WITH_PARENT", "internal", None, "a replica server exits with its front")


def listing() -> str:
    """One line per variable: name, kind, default, help, and its value where set."""
    rows = []
    for s in SWITCHES.values():
        now = os.environ.get(s.name)
        default = "" if s.default is None else s.default
        tail = f" (now {now!r})" if now is not None else ""
        rows.append(f"{s.name:<28} {s.kind:<8} default={default!r:<5} {s.help}{tail}")
    return "\n".join(rows)
