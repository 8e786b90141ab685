"""Which KDA states the prefix cache keeps (`--kda-checkpoint-policy`).

- `prompt-end`: the last match-unit boundary of each prompt (a follow-up that extends the
  prompt hits there);
- `junction`: when a new prompt's MLA match runs past its last checkpoint, the end of the MLA
  match (where this prompt diverges from the cached path), so the next sharer hits there;
- `turn-end`: the last boundary a sequence reached while decoding, kept when it finishes (a
  follow-up chat turn re-sends the answer);
- `interval=N`: every N tokens of the prompt (N a multiple of the unit).
All checkpoints are exported inside the normal prefill pass; none forces a chunk split.
"""

from __future__ import annotations

from dataclasses import dataclass

POLICY_NAMES = ("prompt-end", "junction", "turn-end")


@dataclass(frozen=True)
class CheckpointPolicy:
    unit: int = 64
    prompt_end: bool = True
    junction: bool = True
    turn_end: bool = True
    interval: int | None = None

    @classmethod
    def parse(cls, spec: str, unit: int, interval: int | None = None) -> "CheckpointPolicy":
        """`spec`: comma-separated subset of POLICY_NAMES, or "default" (all of them)."""
        names = set(POLICY_NAMES) if spec == "default" else {s.strip() for s in spec.split(",") if s.strip()}
        unknown = names - set(POLICY_NAMES)
        if unknown:
            raise ValueError(f"unknown kda checkpoint policy {sorted(unknown)}; choose from {POLICY_NAMES}")
        return cls(unit, "prompt-end" in names, "junction" in names, "turn-end" in names, interval)

    def __post_init__(self):
        if self.unit < 1:
            raise ValueError("prefix_match_unit must be positive")
        if self.interval is not None and (self.interval < self.unit or self.interval % self.unit):
            raise ValueError(
                f"checkpoint interval {self.interval} must be a positive multiple of prefix_match_unit={self.unit}"
            )

    def boundaries(self, prompt_len: int, hit) -> set[int]:
        """Token boundaries past the hit at which to snapshot while prefilling this prompt."""
        u, out = self.unit, set()
        if self.prompt_end:
            out.add(prompt_len // u * u)
        if self.junction and hit.k_mla > hit.k_hit:
            out.add(hit.k_mla * u)
        if self.interval:
            out.update(range(self.interval, prompt_len + 1, self.interval))
        return {b for b in out if b > hit.length}
