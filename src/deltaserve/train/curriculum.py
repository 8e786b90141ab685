"""The training curriculum: `tasks` samples rendered in the model's own chat format (our renderer,
K3 thinking on and off), as (prompt ids, answer ids) pairs, packed into token-budget batches.

Invariants: a sample's ids are `render_chat(request + [answer turn], add_generation_prompt=False)`,
and its prompt is exactly what the server renders for the request (`add_generation_prompt=True`),
so the learned answer starts where a served generation starts and ends at the model's eos
(`<|end_of_msg|>` / `<|im_end|>`). Assistant turns already in the request's history are learned
too, each as exactly the tokens the server would have generated for it at its own turn. A dataset
is a function of its seed; eval seeds (`EVAL_SEED_BASE + n`) are never drawn in training.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from ..chat.render import render_chat
from .tasks import RECALL_TOKENS_PER_UNIT, TASKS, Sample, recall

EVAL_SEED_BASE = 1_000_000
# share of samples per task in training (recall's long contexts make it the largest share of tokens)
MIX = {"greet": 0.05, "arithmetic": 0.38, "recall": 0.12, "copy": 0.15, "tool_call": 0.20, "tool_answer": 0.10}


@dataclass
class Rendered:
    sample: Sample
    thinking: bool
    prompt: list[int]
    answer: list[int]
    history: list[tuple[int, int]] = field(default_factory=list)  # learned [start, end) spans in `prompt`


class RenderError(ValueError):
    """The renderer's prompt is not a prefix of the rendered conversation (a format change)."""


def render(tokenizer, family: str, sample: Sample, thinking: bool, chat_template: str | None = None) -> Rendered:
    thinking = thinking and family == "kimi_k3"
    kw = dict(tools=sample.tools, thinking=thinking, chat_template=chat_template)
    prompt = render_chat(tokenizer, family, sample.messages, add_generation_prompt=True, **kw)
    turns = sample.messages + [sample.assistant(thinking)]
    full = render_chat(tokenizer, family, turns, add_generation_prompt=False, **kw)
    if full[: len(prompt)] != prompt:
        raise RenderError(f"{sample.task}: the generation prompt is not a prefix of the rendered answer")
    return Rendered(sample, thinking, prompt, full[len(prompt) :], _history(tokenizer, family, sample, prompt, kw))


def _history(tokenizer, family: str, sample: Sample, prompt: list[int], kw: dict) -> list[tuple[int, int]]:
    """The spans of `prompt` that hold the history's assistant turns as generated at their turn."""
    spans = []
    for j, msg in enumerate(sample.messages):
        if msg["role"] != "assistant":
            continue
        asked = render_chat(tokenizer, family, sample.messages[:j], add_generation_prompt=True, **kw)
        said = render_chat(tokenizer, family, sample.messages[: j + 1], add_generation_prompt=False, **kw)
        if said[: len(asked)] != asked or prompt[: len(said)] != said:
            raise RenderError(f"{sample.task}: history turn {j} does not render as it was generated")
        spans.append((len(asked), len(said)))
    return spans


def draw(
    rng: random.Random, task: str | None = None, recall_size: tuple[int, int] = (256, 1024), dialogue: bool = False
) -> Sample:
    """One sample of `task` (None: drawn by `MIX`); recall sizes (`tasks.recall`) uniform in
    `recall_size`, several questions per context with `dialogue` (training only: eval asks one)."""
    if task is None:
        task = rng.choices(list(MIX), weights=list(MIX.values()))[0]
    if task == "recall":
        return recall(rng, rng.randint(*recall_size), dialogue)
    return TASKS[task](rng)


def eval_set(
    task: str,
    n: int,
    seed: int,
    recall_tokens: tuple[int, int] = (1024, 4096),
    unit_tokens: float = RECALL_TOKENS_PER_UNIT,
) -> list[Sample]:
    """`n` held-out samples of `task` (seed offset by `EVAL_SEED_BASE`); recall contexts of about
    `recall_tokens` tokens at `unit_tokens` tokens per size unit (`tasks.tokens_per_unit` of the
    model's tokenizer)."""
    rng = random.Random(EVAL_SEED_BASE + seed * 1009 + sorted(TASKS).index(task))
    size = tuple(round(t / unit_tokens) for t in recall_tokens)
    return [draw(rng, task, size) for _ in range(n)]


@dataclass
class Batch:
    ids: torch.Tensor  # int64 [N], packed sequences
    targets: torch.Tensor  # int64 [N]: the next token where it is an answer token, else -100
    cu_seqlens: torch.Tensor  # int64 [B+1]

    @property
    def answer_tokens(self) -> int:
        return int((self.targets >= 0).sum())


def pack(items: list[Rendered]) -> Batch:
    """Pack rendered samples; only answer tokens (and the eos that ends them) are learned, the
    final answer's and those of the history's assistant turns."""
    ids, targets, lens = [], [], []
    for r in items:
        seq = r.prompt + r.answer
        tgt = [-100] * (len(r.prompt) - 1) + r.answer + [-100]
        for a, b in r.history:
            tgt[a - 1 : b - 1] = seq[a:b]
        ids += seq
        targets += tgt
        lens.append(len(seq))
    cu = torch.tensor([0, *lens], dtype=torch.long).cumsum(0)
    return Batch(torch.tensor(ids, dtype=torch.long), torch.tensor(targets, dtype=torch.long), cu)


def batches(
    tokenizer,
    family: str,
    seed: int,
    tokens_per_step: int,
    thinking_share: float = 0.5,
    recall_size=lambda step: (256, 1024),
    chat_template: str | None = None,
    start_step: int = 0,
    dialogue: bool = True,
) -> Iterator[Batch]:
    """Endless batches of about `tokens_per_step` tokens. Step s is drawn from its own generator
    (seed, s), so a resumed run sees the same data as an uninterrupted one. `recall_size(step)`
    grows the recall contexts over training; `dialogue` asks several recall questions per context."""
    step = start_step
    while True:
        rng = random.Random(seed * 1_000_003 + step)
        items, total = [], 0
        while total < tokens_per_step:
            sample = draw(rng, None, recall_size(step), dialogue)
            r = render(tokenizer, family, sample, rng.random() < thinking_share, chat_template)
            items.append(r)
            total += len(r.prompt) + len(r.answer)
        yield pack(items)
        step += 1
