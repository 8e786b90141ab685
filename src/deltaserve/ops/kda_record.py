"""`KdaRecord`: a decode step's record of what each KDA layer's recurrence reads of each row, so that
some of the rows can be applied again later without the rest of the model (a speculative verify's
rollback: engine/exec/chained_verify.py restores the pre-verify slot and replays only the verified
rows' KDA updates).

The step's cache carries it (`ForwardBatch.kda_record`); a backend whose decode kernels can record a
layer (the native CPU block and whole-stack kernels: q, k, v before the conv, the gate input f and
the beta logit, bf16, `4P + H` values a row) takes that layer's buffer with the layer's plan; a layer
run any other way stays unrecorded, and `covers` then says no (the caller falls back to running the
rows again). Plain decode steps carry none and pay nothing.
"""

from __future__ import annotations

import torch


class KdaRecord:
    """Per recorded KDA layer: (its backend plan, its buffer of `rows` rows). One per decode step."""

    def __init__(self, rows: int):
        self.rows = rows
        self.layers: dict[int, tuple[object, torch.Tensor]] = {}

    def take(self, layers: list[tuple[int, object, int]]) -> list[torch.Tensor]:
        """Buffers for (layer, plan, values a row) of `layers` (`rows` rows each, bf16, one
        allocation), registered as that layer's record: the backend fills them in this step."""
        flat = torch.empty(self.rows * sum(w for *_, w in layers), dtype=torch.bfloat16)
        out, at = [], 0
        for layer, plan, width in layers:
            buf = flat[at : at + self.rows * width]
            at += buf.numel()
            self.layers[layer] = (plan, buf)
            out.append(buf)
        return out

    def layer(self, layer: int):
        """`take` for one layer, as a backend's `kda_decode` calls it: (plan, values a row) -> buffer."""
        return lambda plan, width: self.take([(layer, plan, width)])[0]

    def drop(self, layers: list[int]) -> None:
        """Forget `layers`' records (the backend took buffers but then did not run the step)."""
        for layer in layers:
            self.layers.pop(layer, None)

    def covers(self, layers: list[int]) -> bool:
        """Every one of `layers` was recorded in this step."""
        return all(layer in self.layers for layer in layers)

    @property
    def nbytes(self) -> int:
        return sum(buf.numel() * buf.element_size() for _, buf in self.layers.values())
