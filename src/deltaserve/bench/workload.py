"""A seeded multi-turn agentic workload: one shared system prompt plus tool definitions, sessions
that branch off other sessions' histories, and histories that grow by the model's own answers.

Turn r of session s sends `history + user_message`; the answer is appended to the history.
A branching session copies another session's history at its first turn and diverges from there.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field


@dataclass
class Session:
    history: list[int]
    turns: list[list[int]] = field(default_factory=list)  # user messages, one per round


@dataclass(frozen=True)
class WorkloadSpec:
    sessions: int = 8
    rounds: int = 3
    system_tokens: int = 1500
    tool_tokens: int = 700
    user_tokens: tuple[int, int] = (40, 400)
    branch_fraction: float = 0.5
    seed: int = 0


def build_sessions(spec: WorkloadSpec, vocab: int, avoid: set[int]) -> list[Session]:
    """Token ids are drawn from [0, vocab) minus `avoid` (special / stop ids)."""
    rng = random.Random(spec.seed)
    pool = [t for t in range(vocab) if t not in avoid]

    def text(n: int) -> list[int]:
        return [rng.choice(pool) for _ in range(n)]

    prefix = text(spec.system_tokens) + text(spec.tool_tokens)
    sessions: list[Session] = []
    for s in range(spec.sessions):
        if sessions and rng.random() < spec.branch_fraction:
            parent = rng.choice(sessions)
            base = list(prefix) + parent.turns[0][: rng.randrange(1, len(parent.turns[0]))]
        else:
            base = list(prefix)
        sess = Session(base)
        sess.turns = [text(rng.randrange(*spec.user_tokens)) for _ in range(spec.rounds)]
        sessions.append(sess)
    return sessions


def ideal_computed(prompts: list[list[int]], seen: list[list[int]]) -> int:
    """Prefill tokens a token-exact cache must compute: per prompt, what lies past its longest
    common prefix with anything seen before (earlier rounds' prompts and answers, and the
    earlier prompts of this round, which `seen` gains as they are counted), at least one."""
    total = 0
    for p in prompts:
        best = 0
        for q in seen:
            n = min(len(p), len(q))
            k = 0
            while k < n and p[k] == q[k]:
                k += 1
            best = max(best, k)
        total += max(1, len(p) - best)
        seen.append(p)
    return total
