"""`EngineCore`: requests in, finished `RequestOutput`s out, one scheduler step at a time.

All validation happens in `add_request` before anything is queued, so a rejected request leaves
no trace; finished and aborted sequences free their cache in the same call. A request with
`params.structured` gets one grammar state per sequence (compiled at add time), advanced by each
accepted token; a sequence finishes with "stop" as soon as its grammar is complete (no step is
spent on the EOS that is all a complete grammar allows), and with "error" (`stop_reason` = the
message) if its grammar rejects a token or fails. A request whose output starts inside a
reasoning section gets a `ReasoningBudget` per sequence (engine/request/reasoning.py): its
`thinking_token_budget`, or `structured_thinking_budget` when a structured output starts after
the reasoning and the request sets none (None: unlimited).

Images (`add_request(..., images=...)`, engine/request/mm_inputs.py): the prompt's `<|media_pad|>` runs
(and K3's `<|kimi_image_placeholder|>`, if the tokenizer has it, read as a lone pad) are matched
to the images in order and lone pads expanded; the request's `prompt_token_ids`
are the expanded ids. Only a model loaded with its vision tower (`encoder`) accepts images (at most
`max_image_patches` patches a request); the runner's encoder cache encodes them a bounded share
per step (`encoder_patches_per_step`), so sequences that do not wait for them keep stepping.
"""

from __future__ import annotations

import copy
import threading
from collections import Counter
from dataclasses import dataclass

import torch

from ...cache.manager import CacheManager
from ...model.kimi import KimiForCausalLM
from ...ops import fallbacks
from ..config import DEFAULT_MAX_IMAGE_PATCHES, DEFAULT_STRUCTURED_THINKING_BUDGET
from ..exec.encoder_cache import EncoderCache, encoder_stats
from ..exec.runner import ModelRunner
from ..exec.sampler import SamplingRow
from ..request.detokenizer import IncrementalDetokenizer
from ..request.mm_inputs import ImagePrompts, MmPrompt
from ..request.multimodal import ImageInput
from ..request.outputs import CompletionOutput, Logprob, RequestOutput
from ..request.reasoning import ReasoningBudget, piece_ids
from ..request.request_check import check_request
from ..request.sampling_params import SamplingParams
from ..request.sequence import InvalidRequestError, SeqStatus, Sequence
from ..request.structured import GrammarCompiler, GrammarState, StructuredOutputError
from ..sched.handoff import claimable
from ..sched.scheduler import Scheduler
from ..spec.decoder import SpecDecoder, step_row_cap
from .deltas import SeqDelta, step_deltas


@dataclass
class _Request:
    request_id: str
    prompt: str | None
    prompt_ids: list[int]
    seqs: list[Sequence]

    @property
    def finished(self) -> bool:
        return all(s.finished for s in self.seqs)


class EngineCore:
    def __init__(
        self,
        model: KimiForCausalLM,
        tokenizer,
        cache: CacheManager,
        *,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        seed: int = 0,
        structured_thinking_budget: int | None = DEFAULT_STRUCTURED_THINKING_BUDGET,
        encoder: EncoderCache | None = None,  # a vision model's (engine/exec/encoder_cache.py)
        max_image_patches: int = DEFAULT_MAX_IMAGE_PATCHES,
        spec: SpecDecoder | None = None,  # speculative decoding (engine/spec)
    ):
        self.model, self.tokenizer, self.cache = model, tokenizer, cache
        self.max_model_len = max_model_len
        self.scheduler = Scheduler(cache, max_num_seqs, max_num_batched_tokens)
        self.runner = ModelRunner(model, cache)
        self.requests: dict[str, _Request] = {}
        self.counters: Counter[str] = Counter()
        self._rng = torch.Generator().manual_seed(seed)
        self._next_seq = 0
        eos = set(tokenizer.stop_token_ids) if tokenizer is not None else set()
        if model.config.eos_token_id is not None:
            eos.add(model.config.eos_token_id)
        self.eos_ids = frozenset(eos)
        self.grammars: dict[int, GrammarState] = {}  # seq_id -> structured-output state
        self._grammar_compiler: GrammarCompiler | None = None
        self._compiler_lock = threading.Lock()
        self.structured_thinking_budget = structured_thinking_budget
        self.budgets: dict[int, ReasoningBudget] = {}  # seq_id -> reasoning budget state
        self.parked: dict[str, int] = {}  # request_id -> seq_id of a parked prefill (handoff.py)
        self.reserved: set[int] = set()  # seq_ids of handoff reservations no request has claimed yet
        self.runner.encoder = encoder
        self.spec = spec
        if spec is not None:
            self.scheduler.drafter = spec.propose
            self.scheduler.max_step_rows = step_row_cap(model)
        if encoder is not None:
            self.scheduler.gate = encoder.gate
        pad = model.config.media_placeholder_token_id
        self.image_prompts = ImagePrompts(tokenizer, pad, self.runner.encoder, max_model_len, max_image_patches)

    def validate(
        self, request_id: str, prompt_ids: list[int], params: SamplingParams, images: list[ImageInput] | None = None
    ) -> None:
        """Raise `InvalidRequestError` if `add_request` would refuse the request."""
        self._check(request_id, prompt_ids, params, images)

    def _check(
        self, request_id: str, prompt_ids: list[int], params: SamplingParams, images: list[ImageInput] | None
    ) -> MmPrompt | None:
        return check_request(self, request_id, prompt_ids, params, images)

    def precompile(self, params: SamplingParams) -> None:
        """Compile (and cache) `params.structured`, raising `InvalidRequestError` if it is refused.
        Thread-safe: it touches only the grammar compiler, so a server runs it off its event
        loop and the engine thread's `add_request` then finds the grammar cached."""
        if params.structured is not None and self.tokenizer is not None:
            self._compile(params)

    def _compile(self, params: SamplingParams) -> GrammarState | None:
        if params.structured is None:
            return None
        try:
            with self._compiler_lock:
                if self._grammar_compiler is None:
                    self._grammar_compiler = GrammarCompiler(
                        self.tokenizer, self.model.config.vocab_size, sorted(self.eos_ids)
                    )
            return self._grammar_compiler.compile(params.structured)
        except StructuredOutputError as e:
            raise InvalidRequestError(str(e)) from None

    def _budget(self, params: SamplingParams) -> ReasoningBudget | None:
        budget = params.thinking_token_budget
        if budget is None and params.structured is not None and params.structured.prefix:
            budget = self.structured_thinking_budget
        if budget is None or self.tokenizer is None:
            return None
        try:
            end = piece_ids(self.tokenizer, params.reasoning_close)
        except StructuredOutputError as e:
            raise InvalidRequestError(str(e)) from None
        return ReasoningBudget(budget, end, self.tokenizer.special_ids)

    def add_request(
        self,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        prompt: str | None = None,
        cache_salt: str | None = None,
        images: list[ImageInput] | None = None,
        *,
        prefill_only: bool = False,
        received: int | tuple[int, ...] | None = None,
    ) -> None:
        """`prefill_only`: compute the prompt and park its cache (`engine/sched/handoff.py`), sampling
        nothing (n must be 1). `received`: the sequence ids of a handoff reservation (one per
        sample, `handoff.reserve`) holding the cache of every prompt token but the last (the
        expanded prompt's, with images); the request runs from there."""
        mm = self._check(request_id, prompt_ids, params, images)
        if prefill_only and params.n != 1:
            raise InvalidRequestError("a prefill for a handoff takes one sample")
        if mm is not None:
            prompt_ids = mm.ids
        ids = claimable(self, received, params.n, len(prompt_ids))
        grammar = self._compile(params)
        budget = self._budget(params)
        seqs = []
        for i in range(params.n):
            gen = torch.Generator().manual_seed((params.seed + i) % 2**64) if params.seed is not None else self._rng
            detok = IncrementalDetokenizer(self.tokenizer, params) if self.tokenizer is not None else None
            seqs.append(
                Sequence(
                    self._next_seq if ids is None else ids[i],
                    request_id,
                    i,
                    list(prompt_ids),
                    params,
                    gen,
                    detok,
                    logprobs=[] if params.logprobs is not None else None,
                    cache_salt=cache_salt,
                    images=mm.images if mm is not None else (),
                    image_starts=mm.starts if mm is not None else (),
                    prefill_only=prefill_only,
                    preadmitted=ids is not None,
                    num_computed=len(prompt_ids) - 1 if ids is not None else 0,
                )
            )
            if grammar is not None:
                self.grammars[seqs[-1].seq_id] = grammar.copy()
            if budget is not None:
                self.budgets[seqs[-1].seq_id] = copy.copy(budget)
            self._next_seq += ids is None
        self.requests[request_id] = _Request(request_id, prompt, list(prompt_ids), seqs)
        self.reserved.difference_update(ids or ())  # claimed: from now on the request owns the reservation
        for s in seqs:
            self.scheduler.add(s)
        self.counters["requests_added"] += 1
        self.counters["prompt_tokens"] += len(prompt_ids) * params.n

    def abort_request(self, request_id: str) -> RequestOutput | None:
        req = self.requests.pop(request_id, None)
        if req is None:
            return None
        for s in req.seqs:
            if not s.finished:
                self.scheduler.remove(s)
                self._finish(s, "abort")
            self.grammars.pop(s.seq_id, None)
            self.budgets.pop(s.seq_id, None)
        self.counters["requests_aborted"] += 1
        return self._output(req)

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def _banned(self, seq: Sequence) -> list[int]:
        if len(seq.output_ids) >= seq.params.min_tokens:
            return []
        return sorted(seq.params.stop_ids(self.eos_ids))

    def step(self) -> list[RequestOutput]:
        """One scheduler step and its share of image encodes; returns the finished requests."""
        if self.spec is not None:  # the step's drafts, asked for once for every decoding sequence
            self.spec.prepare(self.runner, self.scheduler.running, self.scheduler.max_step_rows)
        scheduled = self.scheduler.schedule()
        if self.runner.encoder is not None:
            self.runner.encoder.step(self.scheduler.running)
        if not scheduled:
            return []
        rows = [
            SamplingRow(
                s.seq.params,
                s.seq.generator,
                s.seq.prompt_ids,
                s.seq.output_ids,
                banned_ids=self._banned(s.seq),
                grammar=self.grammars.get(s.seq.seq_id),
                forced=self._forced(s.seq.seq_id),
            )
            if s.completes and not s.seq.prefill_only
            else None
            for s in scheduled
        ]
        verifying = self.spec is not None and any(s.drafts for s in scheduled)
        tokens, lps = self.spec.execute(self.runner, scheduled, rows) if verifying else self._sample(scheduled, rows)
        appended = [self._append_all(s.seq, t, lp) for s, t, lp in zip(scheduled, tokens, lps)]
        if self.spec is not None:  # fold the verified tokens (each verifies the fed token before it)
            self.spec.settle(self.runner, scheduled, rows, appended)
        self.counters["steps"] += 1
        done: list[RequestOutput] = []
        for s, m in zip(scheduled, appended):
            advance = s.num_new - 1 + m if m else s.num_new
            s.seq.num_computed += advance
            self.counters["computed_tokens"] += advance
            if self.cache.prefix_enabled:
                self.cache.commit(s.seq.seq_id, s.seq.all_ids(), s.seq.num_computed, s.seq.image_spans)
            if s.seq.prefill_only and s.seq.num_pending == 0:
                done += self._park(s.seq)
            if m and s.seq.finished:
                done += self._retire(s.seq)
        return done

    def _sample(self, scheduled: list, rows: list[SamplingRow | None]) -> tuple[list[list[int]], list[list]]:
        """A step without drafts: one token (and its logprobs) per completing sequence, [] for the rest."""
        sampled = self.runner.execute(scheduled, rows)
        tokens: list[list[int]] = [[] for _ in scheduled]
        lps: list[list] = [[] for _ in scheduled]
        for j, i in enumerate(i for i, r in enumerate(rows) if r is not None):
            tokens[i], lps[i] = [sampled.token_ids[j]], [sampled.logprobs[j]]
        return tokens, lps

    def _append_all(self, seq: Sequence, tokens: list[int], lps: list) -> int:
        """Append `tokens` until the sequence finishes; how many were appended."""
        for m, (token, lp) in enumerate(zip(tokens, lps), 1):
            self._append(seq, token, lp)
            if seq.finished:
                return m
        return len(tokens)

    def _retire(self, seq: Sequence) -> list[RequestOutput]:
        """A sequence finished in this step: free it; its request's output once all are done."""
        self.scheduler.remove(seq)
        self.grammars.pop(seq.seq_id, None)
        self.budgets.pop(seq.seq_id, None)
        if self.spec is not None:
            self.spec.finished(seq)
        req = self.requests.get(seq.request_id)  # gone: a sibling finished in this step retired it
        if req is None or not req.finished:
            return []
        del self.requests[req.request_id]
        self.counters["requests_finished"] += 1
        return [self._output(req)]

    def _park(self, seq: Sequence) -> list[RequestOutput]:
        """A prefill-only sequence is computed: detach it with its cache (freed by
        `handoff.release_parked`) and finish its request with reason "prefilled"."""
        self.scheduler.detach(seq)
        self.parked[seq.request_id] = seq.seq_id
        self._finish(seq, "prefilled")
        req = self.requests.pop(seq.request_id)
        self.counters["requests_finished"] += 1
        return [self._output(req)]

    def _forced(self, seq_id: int) -> int | None:
        budget = self.budgets.get(seq_id)
        return budget.forced() if budget is not None else None

    def step_deltas(self) -> list[SeqDelta]:
        """`step()`, reported per sequence for streaming (`deltas.step_deltas`)."""
        return step_deltas(self)

    def _append(self, seq: Sequence, token: int, lp) -> None:
        seq.output_ids.append(token)
        self.counters["generated_tokens"] += 1
        if lp is not None and seq.logprobs is not None:
            entry = {t: Logprob(v, None, self._piece(t)) for t, v in lp.top.items()}
            entry[token] = Logprob(lp.logprob, lp.rank, self._piece(token))
            seq.logprobs.append(entry)
            seq.cumulative_logprob += lp.logprob
        p = seq.params
        grammar = self.grammars.get(seq.seq_id)
        grammar_done = grammar is not None and grammar.advance(token)
        budget = self.budgets.get(seq.seq_id)
        if budget is not None:
            budget.advance(token)
        failure = grammar.failure if grammar_done else None
        if failure is not None:
            self._finish(seq, "error", failure)
        elif len(seq.output_ids) >= p.min_tokens and token in p.stop_ids(self.eos_ids):
            self._finish(seq, "stop", token if token in p.stop_token_ids else None)
        elif seq.detokenizer is not None and seq.detokenizer.append(token):
            self._finish(seq, "stop", seq.detokenizer.stop_reason)
        elif grammar_done:
            self._finish(seq, "stop")
        elif (p.max_tokens is not None and len(seq.output_ids) >= p.max_tokens) or seq.num_tokens >= self.max_model_len:
            self._finish(seq, "length")

    def _piece(self, token: int) -> str | None:
        return self.tokenizer.decode([token]) if self.tokenizer is not None else None

    @staticmethod
    def _finish(seq: Sequence, reason: str, stop_reason: str | int | None = None) -> None:
        """Mark finished; the detokenizer's last delta flushes a dangling UTF-8 tail as U+FFFD so
        `text == decode(token_ids)`. The flushed piece is kept for streaming consumers."""
        seq.status = SeqStatus.FINISHED
        seq.finish_reason, seq.stop_reason = reason, stop_reason
        if seq.detokenizer is not None:
            seq.final_delta = seq.detokenizer.delta(final=True)

    @staticmethod
    def _output(req: _Request) -> RequestOutput:
        outs = [
            CompletionOutput(
                s.index,
                s.text,
                list(s.output_ids),
                s.cumulative_logprob if s.logprobs is not None else None,
                s.logprobs,
                s.finish_reason,
                s.stop_reason,
            )
            for s in req.seqs
        ]
        return RequestOutput(req.request_id, req.prompt, req.prompt_ids, outs, req.finished)

    def stats(self) -> dict:
        out = {
            k: self.counters[k]
            for k in (
                "steps",
                "requests_added",
                "requests_finished",
                "requests_aborted",
                "prompt_tokens",
                "computed_tokens",
                "generated_tokens",
            )
        }
        sched = self.scheduler
        out.update(preemptions=sched.num_preemptions, num_running=len(sched.running), num_waiting=len(sched.waiting))
        out.update(self.cache.usage())
        out.update(encoder_stats(self.runner.encoder))
        if self.cache.prefix_enabled:
            out["prefix_cache"] = self.cache.prefix_stats()
        if self.spec is not None:
            out["spec_decode"] = self.spec.stats()
        out["kernel_fallbacks"] = fallbacks.table()  # this process's: rank 0's under TP
        if (load := self.runner.expert_load()) is not None:  # wide expert parallelism (engine/core/lockstep.py)
            out.update(expert_load=load, **{k: self.counters[k] for k in ("idle_forwards", "ep_rounds")})
        return out
