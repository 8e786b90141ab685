"""Whether an answer does its task. An answer is what the API returns: `content`,
`reasoning_content` and tool calls (name, JSON arguments); `Sample.expect` says what is right."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

from ..train.tasks import Sample


@dataclass
class Answer:
    content: str = ""
    reasoning: str = ""
    tool_calls: list[tuple[str, str]] = field(default_factory=list)  # (name, arguments JSON)
    finish_reason: str | None = None
    logprob: float | None = None  # the answer's cumulative log-probability (offline runs)

    def key(self) -> tuple:
        """What two runs must agree on for "the same answer"."""
        return (self.content, self.reasoning, tuple(self.tool_calls))


def correct(sample: Sample, answer: Answer) -> bool:
    task, want = sample.task, sample.expect
    if task == "arithmetic":
        numbers = re.findall(r"-?\d+", answer.content)
        return bool(numbers) and numbers[-1] == want
    if task == "copy":
        return answer.content.strip() == want
    if task == "tool_call":
        if len(answer.tool_calls) != 1:
            return False
        name, args = answer.tool_calls[0]
        try:
            return name == want["name"] and json.loads(args) == want["arguments"]
        except ValueError:
            return False
    return str(want) in answer.content  # recall, tool_answer, greet


@dataclass
class TaskScore:
    task: str
    total: int = 0
    right: int = 0

    @property
    def accuracy(self) -> float:
        return self.right / self.total if self.total else 0.0


def score(samples: list[Sample], answers: list[Answer]) -> dict[str, TaskScore]:
    out: dict[str, TaskScore] = {}
    for s, a in zip(samples, answers, strict=True):
        t = out.setdefault(s.task, TaskScore(s.task))
        t.total += 1
        t.right += correct(s, a)
    return out
