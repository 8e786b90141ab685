"""`DraftModelProposer`: a small model of our family, from its own checkpoint, drafts greedily.

The drafter holds its own cache (a `CacheManager` without prefix caching over its own MLA pages
and KDA slots): per drafting sequence one live KDA slot and MLA pages for its tokens. Invariant:
a sequence's live drafter slot and MLA rows hold exactly its first `computed[seq]` tokens, all
of them verified (the target's), never a draft.

A `propose` call, batched over the requests (one forward per draft position, never a Python
loop over sequences around a forward):
1. catch-up: each sequence's tokens past `computed` (after a verify step: its accepted drafts
   and the target's token; after admission or a `release`: all of them, chunked under
   `catchup_tokens` a call, a sequence whose catch-up is not complete drafts nothing this step)
   in one packed forward into its live slot; the logits of its last token give draft 1;
2. each sequence with k >= 2 copies its live KDA slot into a scratch slot (one state, not one per
   draft) and feeds draft j at position N + j - 1 on the scratch slot, for j = 1 .. k - 1, one
   batched decode forward each (the batch shrinks as sequences reach their k); scratch slots are
   freed at the end of the call. MLA rows at positions >= N written by drafts are past
   `computed`: never read, overwritten by the next catch-up.
Rolling back after verification is thus free: the live slot never saw a draft, and the next
catch-up feeds the verified tokens (recompute from the kept pre-draft state).

Memory per request: one drafter KDA slot (`slot_bytes`: every KDA layer's state [H, K, V] fp32
and conv tail) and MLA pages for its tokens (`page_bytes` a page), plus while proposing one
scratch slot; the pool is sized for `max_num_seqs` sequences of `max_model_len` + k tokens, at
most the target's page count plus one a sequence (a sequence the pool cannot hold goes undrafted).
Drafts are the drafter's argmax: point masses, as `verify.accept_sampled` needs."""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path

import torch

from ...cache import CacheLayout, CacheManager, ForwardBatch, build_pools
from ...model import KimiForCausalLM, load_model
from ..exec.chained_verify import chains
from ..request.sequence import Sequence
from .proposer import DraftRequest


def _tokenizer_identity(d: Path) -> tuple[str | None, object]:
    """(sha256 of `tiktoken.model` or None, the special tokens map of `tokenizer_config.json`)."""
    ranks = d / "tiktoken.model"
    digest = hashlib.sha256(ranks.read_bytes()).hexdigest() if ranks.is_file() else None
    tcfg = d / "tokenizer_config.json"
    try:
        specials = json.loads(tcfg.read_text()).get("added_tokens_decoder") if tcfg.is_file() else None
    except (json.JSONDecodeError, AttributeError):
        specials = "unreadable"
    return digest, specials


def check_same_vocab(target_dir: str | Path, target: KimiForCausalLM, draft_dir: str | Path, draft) -> None:
    """ValueError unless the drafter's vocabulary size, BPE ranks and special tokens equal the target's."""
    tv, dv = target.config.vocab_size, draft.vocab_size
    if tv != dv:
        raise ValueError(f"draft model {draft_dir}: vocab_size {dv} differs from the target's {tv}")
    t, d = _tokenizer_identity(Path(target_dir)), _tokenizer_identity(Path(draft_dir))
    if t[0] != d[0]:
        raise ValueError(f"draft model {draft_dir}: its tokenizer (tiktoken.model) differs from the target's")
    if t[1] != d[1]:
        raise ValueError(f"draft model {draft_dir}: special tokens (tokenizer_config.json) differ from the target's")


CHAIN_ROWS = 32  # a catch-up of at most this many tokens a sequence runs as chained decode rows


def relative_cost(draft: KimiForCausalLM, target: KimiForCausalLM) -> float:
    """A drafter forward's cost in target decode steps: the larger of the layer-count and the
    parameter-count ratios (small models on a CPU pay per layer call; large ones per weight read)."""
    layers = draft.config.num_hidden_layers / target.config.num_hidden_layers
    params = sum(p.numel() for p in draft.parameters()) / max(1, sum(p.numel() for p in target.parameters()))
    return max(layers, params)


class DraftModelProposer:
    wants_hidden = False
    draft_cost = 1.0  # per draft token, in target decode steps (`load` sets it: `relative_cost`)

    def __init__(
        self,
        model: KimiForCausalLM,
        max_num_seqs: int,
        max_model_len: int,
        k_max: int,
        page_size: int,
        catchup_tokens: int,
        max_pages: int | None = None,
    ):
        """`max_pages`: at most this many MLA pages (the builder passes the target's page count plus
        one a sequence, so the drafter never holds more tokens than the target can)."""
        self.model, self.catchup_tokens = model, catchup_tokens
        pages = max_num_seqs * math.ceil((max_model_len + k_max) / page_size)
        pages = pages if max_pages is None else min(pages, max_pages)
        layout = CacheLayout(page_size, pages, 2 * max_num_seqs, 0, 0, model.dtype, torch.float32)
        mla, kda, _ = build_pools(model.config, layout, model.device)
        self.cache = CacheManager(mla, kda)
        self.chained = chains(model, self.cache)
        self.computed: dict[Sequence, int] = {}
        self.counts = {"forwards": 0, "catchup_tokens": 0, "rebuilds": 0}
        self._released: set[int] = set()  # seq ids released while unfinished (a later admit rebuilds)

    @classmethod
    def load(cls, path: str, target: KimiForCausalLM, target_dir: str, **kw) -> DraftModelProposer:
        """The drafter at `path`, in the target's dtype and device (ValueError: not a checkpoint, or
        a vocabulary / tokenizer other than the target's)."""
        from ...model.config import ModelConfig

        if not Path(path).is_dir():
            raise ValueError(f"draft model {path!r} is not a checkpoint directory")
        check_same_vocab(target_dir, target, path, ModelConfig.from_pretrained(path))
        proposer = cls(load_model(path, dtype=target.dtype, device=target.device, progress=False), **kw)
        proposer.draft_cost = relative_cost(proposer.model, target)
        return proposer

    @property
    def slot_bytes(self) -> int:
        kda = self.cache.kda
        tail, state = kda.tails[:, 0], kda.states[:, 0]
        return tail.numel() * tail.element_size() + state.numel() * state.element_size()

    @property
    def page_bytes(self) -> int:
        mla = self.cache.mla
        return mla.storage.numel() * mla.storage.element_size() // mla.num_pages

    def _admit(self, seq: Sequence, tokens: int) -> bool:
        """Hold cache for `seq` (rebuilt from its tokens where it was released); False if short."""
        sid = seq.seq_id
        if seq in self.computed:
            return self.cache.grow(sid, tokens)
        if not self.cache.admit(sid, tokens):
            return False
        self.computed[seq] = 0
        if sid in self._released:
            self._released.discard(sid)
            self.counts["rebuilds"] += 1
        return True

    def _plan(self, requests: list[DraftRequest]) -> list[tuple[DraftRequest, int, int, int]]:
        """(request, catch-up start, tokens fed, k) of each request that runs: k drafts where its
        catch-up completes (k = 1 where its pages cannot cover more), else 0."""
        plan, budget = [], self.catchup_tokens
        for r in requests:
            n, k = r.seq.num_tokens, r.k
            if not self._admit(r.seq, n + k - 1):
                if r.seq not in self.computed or not self.cache.grow(r.seq.seq_id, n):
                    continue
                k = 1
            start = self.computed[r.seq]
            fed = min(n - start, budget)
            if fed <= 0:
                continue
            budget -= fed
            plan.append((r, start, fed, k if start + fed == n else 0))
        return plan

    @torch.inference_mode()
    def propose(self, requests: list[DraftRequest]) -> list[list[int]]:
        plan = self._plan(requests)
        out: dict[int, list[int]] = {id(r): [] for r in requests}
        if plan:
            ids, rows = [], []
            for r, start, fed, k in plan:
                ids.extend(r.seq.token_slice(start, start + fed))
                if k:
                    rows.append(len(ids) - 1)
                self.computed[r.seq] = start + fed
            self.counts["catchup_tokens"] += len(ids)
            seqs = [r.seq for r, *_ in plan]
            slots = [self.cache.seqs[s.seq_id].slot for s in seqs]
            logits = self._forward(ids, [p[1] for p in plan], [p[2] for p in plan], seqs, slots, rows)
            ready = [(r, k) for r, _, _, k in plan if k]
            for (r, _), t in zip(ready, logits.argmax(dim=-1).tolist()):
                out[id(r)].append(t)
            self._continue([(r, k) for r, k in ready if k > 1], out)
        return [out[id(r)] for r in requests]

    def _forward(self, ids: list[int], starts: list[int], lens: list[int], seqs: list[Sequence], slots, rows):
        """fp32 logits at packed `rows` of one drafter forward (each sequence's pages, `slots`). A
        catch-up of a few tokens a sequence runs as chained decode rows where the drafter's backend
        chains them (engine/exec/chained_verify.py), not as a prefill."""
        pages = [self.cache.seqs[s.seq_id].pages for s in seqs]
        mla, kda, model = self.cache.mla, self.cache.kda, self.model
        if self.chained and min(starts) > 0 and 1 < max(lens) <= CHAIN_ROWS:
            pages = [p for p, n in zip(pages, lens) for _ in range(n)]
            slots = [sl for sl, n in zip(slots, lens) for _ in range(n)]
            starts = [s + j for s, n in zip(starts, lens) for j in range(n)]
            lens = [1] * len(ids)
        ids_t = torch.tensor(ids, dtype=torch.long)
        batch = ForwardBatch(ids_t, starts, lens, pages, slots, mla, kda, logit_rows=rows, device=model.device)
        self.counts["forwards"] += 1
        if batch.decode_only:
            logits = model.decode_logits(batch.input_ids, batch.context())
            return logits if rows == list(range(len(ids))) else logits.index_select(0, batch.logit_rows)
        hidden = model(batch.input_ids, batch.context())
        return model.compute_logits(hidden.index_select(0, batch.logit_rows)) if rows else hidden.new_zeros(0, 1)

    def _continue(self, ready: list[tuple[DraftRequest, int]], out: dict[int, list[int]]) -> None:
        """Drafts 2..k of each (request, k) on a scratch copy of its live KDA slot (step 2 above)."""
        if not ready:
            return
        kda = self.cache.kda
        scratch = [kda.allocate() for _ in ready]
        try:
            live = torch.tensor([self.cache.seqs[r.seq.seq_id].slot for r, _ in ready], device=kda.states.device)
            dst = torch.tensor(scratch, device=kda.states.device)
            kda.tails.index_copy_(1, dst, kda.tails.index_select(1, live))
            kda.states.index_copy_(1, dst, kda.states.index_select(1, live))
            for j in range(1, max(k for _, k in ready)):
                act = [i for i, (_, k) in enumerate(ready) if k > j]
                seqs = [ready[i][0].seq for i in act]
                ids = [out[id(ready[i][0])][j - 1] for i in act]
                starts = [s.num_tokens + j - 1 for s in seqs]
                slots = [scratch[i] for i in act]
                logits = self._forward(ids, starts, [1] * len(act), seqs, slots, list(range(len(act))))
                for i, t in zip(act, logits.argmax(dim=-1).tolist()):
                    out[id(ready[i][0])].append(t)
        finally:
            for s in scratch:
                kda.release(s)

    def release(self, seq: Sequence) -> None:
        if self.computed.pop(seq, None) is not None:
            self.cache.free(seq.seq_id)
            self._released.add(seq.seq_id)

    def finished(self, seq: Sequence) -> None:
        if self.computed.pop(seq, None) is not None:
            self.cache.free(seq.seq_id)
        self._released.discard(seq.seq_id)

    def stats(self) -> dict:
        """Drafter forwards, catch-up tokens fed, rebuilds after a release, and the bytes a request holds."""
        return {
            "draft_model": dict(
                self.counts,
                state_bytes_per_request=self.slot_bytes,
                page_bytes=self.page_bytes,
                page_size=self.cache.page_size,
                sequences=len(self.computed),
            )
        }
