"""Run eval samples and collect `score.Answer`s, greedy, through either

- the offline engine (`OfflineRunner`: `LLM` with the path options `EvalPath` names: prefix
  cache warm pass, prefill chunk size, preemption pressure, tensor parallelism), prompts rendered
  by the curriculum's renderer (the server's), outputs parsed by the server's parser; or
- a server URL (`ServerRunner`: `/v1/chat/completions`, thinking by `chat_template_kwargs`), e.g.
  a `deltaserve proxy` in front of a prefill/decode pair.
"""

from __future__ import annotations

from dataclasses import dataclass

import httpx
import torch

from ..cache.budget import unit_bytes
from ..chat.render import load_chat_template
from ..engine.llm import LLM
from ..engine.request.sampling_params import SamplingParams
from ..model.config import ModelConfig
from ..server.parsers import control_token_ids, parse_output
from ..train.curriculum import render
from ..train.tasks import Sample
from .score import Answer

MAX_TOKENS = 192  # room for the longest answer (a thought and a copied passage)


PREEMPT_MODEL_LEN = 6144  # room for the longest eval prompt (recall at 4096 tokens) and its answer


@dataclass
class EvalPath:
    """Engine options that route requests through one state path."""

    prefix_cache: bool = False  # run every prompt twice; score the second (cache-hit) pass
    chunk_size: int | None = None  # max_num_batched_tokens: long prompts prefill in chunks
    preempt: bool = False  # a KV budget that forces preemptions
    preempt_len: int = PREEMPT_MODEL_LEN  # with preempt: the longest request the budget must fit
    tensor_parallel_size: int = 1
    dtype: str = "bfloat16"
    max_num_seqs: int = 16
    threads: int | None = None  # torch threads per rank (1 for TP2 on two cores)
    max_tokens: int = MAX_TOKENS

    def engine_kwargs(self, model_dir) -> dict:
        kw = dict(
            num_threads=self.threads,
            dtype=self.dtype,
            enable_prefix_caching=self.prefix_cache,
            tensor_parallel_size=self.tensor_parallel_size,
            max_num_seqs=self.max_num_seqs,
            progress=False,
            max_model_len=MAX_MODEL_LEN,
        )
        if self.chunk_size:
            kw["max_num_batched_tokens"] = self.chunk_size
        if self.preempt:
            kw["max_model_len"] = self.preempt_len
            kw["kv_cache_memory"] = self.preempt_budget(model_dir)
        return kw

    def preempt_budget(self, model_dir) -> int:
        """A KV budget of `max_num_seqs` KDA slots and MLA pages for 1.25 x `preempt_len` tokens:
        one longest request fits, a few long ones at once do not, so the scheduler preempts."""
        cfg = ModelConfig.from_pretrained(model_dir)
        dtype = torch.float32 if self.dtype == "float32" else torch.bfloat16
        slot, page = unit_bytes(cfg, PAGE_SIZE, dtype, torch.float32)
        return self.max_num_seqs * slot + -(-self.preempt_len * 5 // 4 // PAGE_SIZE) * page


MAX_MODEL_LEN = 8192
PAGE_SIZE = 16  # the engine's default page size


def longest_request(tokenizer, template, family: str, samples: list[Sample], modes: list[bool], max_tokens: int) -> int:
    """Tokens of the longest of `samples`' requests (its prompt rendered in any thinking mode of
    `modes`, plus `max_tokens`): what `EvalPath.preempt_len` must fit."""
    return max(len(render(tokenizer, family, s, m, template).prompt) for s in samples for m in modes) + max_tokens


class OfflineRunner:
    def __init__(self, model_dir, path: EvalPath):
        self.path = path
        self.llm = LLM(model_dir, **path.engine_kwargs(model_dir))
        self.family = self.llm.model.config.family if self.llm.model is not None else None
        self.template = load_chat_template(model_dir)

    def close(self) -> None:
        self.llm.shutdown()

    def run(self, samples: list[Sample], thinking: bool) -> list[Answer]:
        rendered = [render(self.llm.tokenizer, self.family, s, thinking, self.template) for s in samples]
        prompts = [r.prompt for r in rendered]
        keep = control_token_ids(self.llm.tokenizer, self.family)  # decoded as the server decodes
        params = SamplingParams(
            temperature=0.0, max_tokens=self.path.max_tokens, keep_special_token_ids=keep, logprobs=0
        )
        if self.path.prefix_cache:
            self.llm.generate(prompts, params, use_tqdm=False)
        outs = self.llm.generate(prompts, params, use_tqdm=False)
        answers = []
        for s, r, o in zip(samples, rendered, outs):
            parsed = parse_output(o.outputs[0].text, self.family, bool(s.tools), r.thinking)
            calls = [(c.name, c.arguments_json) for c in parsed.tool_calls]
            out = o.outputs[0]
            answers.append(
                Answer(parsed.content, parsed.reasoning_content, calls, out.finish_reason, out.cumulative_logprob)
            )
        return answers

    def stats(self) -> dict:
        return self.llm.stats()


class ServerRunner:
    def __init__(self, url: str, api_key: str | None = None, max_tokens: int = MAX_TOKENS, timeout: float = 600.0):
        self.max_tokens = max_tokens
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.client = httpx.Client(base_url=url.rstrip("/"), headers=headers, timeout=timeout)
        self.model = self.client.get("/v1/models").json()["data"][0]["id"]

    def close(self) -> None:
        self.client.close()

    def run(self, samples: list[Sample], thinking: bool) -> list[Answer]:
        return [self._one(s, thinking) for s in samples]

    def _one(self, s: Sample, thinking: bool) -> Answer:
        body = {
            "model": self.model,
            "messages": s.messages,
            "temperature": 0.0,
            "max_tokens": self.max_tokens,
            "chat_template_kwargs": {"thinking": thinking},
        }
        if s.tools:
            body["tools"] = s.tools
        r = self.client.post("/v1/chat/completions", json=body)
        if r.status_code != 200:
            raise RuntimeError(f"{self.client.base_url} answered {r.status_code}: {r.text[:500]}")
        choice = r.json()["choices"][0]
        msg = choice["message"]
        calls = [(c["function"]["name"], c["function"]["arguments"]) for c in msg.get("tool_calls") or []]
        return Answer(msg.get("content") or "", msg.get("reasoning_content") or "", calls, choice.get("finish_reason"))
