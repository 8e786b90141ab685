"""The decode role: take a prompt's cache from a prefill instance, fail-closed, then decode.

`DecodeHandoff.submit` replaces `ServerState.submit` when the proxy names a prefill instance
(`PREFILL_HEADER`, accepted only with the shared secret). In order:
1. On the engine thread: check the request and expand its images' pad runs (`Ask`); if this
   instance's own joint hit (MLA pages and a KDA checkpoint) leaves at most
   `local_prefill_tokens` to compute, run the request here (no transfer); else reserve cache
   for its n samples (`engine.sched.handoff.reserve`): pages its prefix cache holds are
   shared, the transfer starts after them; samples 2..n are forks of the first. While the
   pools are short the reservation waits on the engine thread (`AsyncEngine.call_when`: FIFO,
   retried as slots and pages free), as a queued request would, behind the requests queued
   here before it (`reserve_behind`), never falling back to computing the prompt here before
   the handoff timeout.
2. Ask the prefill instance for the prompt minus its last token, with the images' pixels
   (`/disagg/prefill`, `images.py`), check the header against this request and instance (its
   fresh handoff id, fingerprint, token count, prompt and image digests' hash, start, region
   shapes).
3. Read the regions in place into the reservation (every rank its own, each KDA head block from
   the prefill rank holding it, whatever the two sizes: `plan.plan_reads`, `InstanceRanks.read`;
   the MLA rows, the same on every rank, only rank 0 reads from the prefill instance and the
   other ranks then from rank 0: `_share_mla`), release the prefill side (which confirms the
   generation was parked throughout), hash the received bytes on every rank and compare with
   the digests of their sources.
4. Only then copy the received cache into the forks and queue the request from its last
   prompt token, every sample (`add_request(received=...)`).
Any failure cancels the reservation; the request is then recomputed here (`on_failure=
"recompute"`) or refused with a 502 (`"error"`), and counted. No token is ever sampled from
unverified state. Every request computed here instead (`bypass_reason`, a local prefill, a
refusal, a reservation timeout, a recomputed failure) counts in `bypasses` by reason
(`deltaserve:pd_bypass_total`). `tamper`, a test hook, may alter the header or the received bytes.
"""

from __future__ import annotations

import asyncio
import contextvars
import time
import uuid
from collections import Counter
from dataclasses import dataclass
from typing import Callable

import httpx
import msgspec
from fastapi import APIRouter, Request

from ..cache.handoff import handoff_fingerprint, prompt_hash
from ..engine.exec.messages import RankRead
from ..engine.exec.rank_transfer import spans
from ..engine.request.sequence import InvalidRequestError
from ..engine.sched.handoff import Reservation, cancel, fill_forks, reserve
from ..parallel.kv_transfer import TransferError
from ..server.async_engine import AsyncEngine
from ..server.errors import APIError
from .images import last_in_image, pack_image
from .matching import add_match_route
from .plan import plan_reads
from .protocol import (
    MSGPACK,
    PREFILL_HEADER,
    SECRET_HEADER,
    PrefillRequest,
    Release,
    ReleaseReply,
    TransferHeader,
    authorized,
    decode,
    encode,
)
from .ranks import InstanceRanks
from .service import check_secret, engine_state

PREFILL_TARGET: contextvars.ContextVar[str | None] = contextvars.ContextVar("prefill_target", default=None)
# `_reserve`'s answers that are neither a reservation nor a local prefill
REFUSED, TIMED_OUT, IMAGE_AT_END = -1, -2, -3
LOCAL_REASONS = {REFUSED: "invalid", TIMED_OUT: "reserve_timeout", IMAGE_AT_END: "images"}


def bypass_reason(url: str | None, ids: list[int], params, images) -> str | None:
    """Why a request goes around the handoff before any reservation (`deltaserve:pd_bypass_total`),
    or None: no prefill instance named (or not with the shared secret), a prompt of one token
    (nothing to prefill). Images and n > 1 go through the handoff (a prompt ending inside an
    image's span does not: `_plan`)."""
    if url is None:
        return "no_prefill_target"
    return "short_prompt" if len(ids) < 2 else None


@dataclass(frozen=True)
class Ask:
    """A request as the handoff moves it: the prompt with its images' pad runs expanded, the
    image spans (`Sequence.image_spans`) and the number of samples."""

    tokens: list[int]
    spans: tuple[tuple[int, int, bytes], ...] = ()
    n: int = 1

    @property
    def digests(self) -> tuple[bytes, ...]:
        return tuple(d for _, _, d in self.spans)


def ask_of(core, ids: list[int], params, images) -> Ask:
    """On the engine thread: the request checked as `add_request` would (`InvalidRequestError`)."""
    mm = core._check(f"handoff-check-{core._next_seq}", ids, params, images)
    if mm is None:
        return Ask(list(ids), (), params.n)
    spans = tuple((s, s + im.image.num_tokens, im.digest) for s, im in zip(mm.starts, mm.images))
    return Ask(mm.ids, spans, params.n)


class HandoffError(RuntimeError):
    def __init__(self, reason: str, detail: str = ""):
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason


class PrefillTarget:
    """Pure ASGI middleware: a request carrying the shared secret may name its prefill instance."""

    def __init__(self, app, secret: str):
        self.app, self.secret = app, secret

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {k.decode().lower(): v.decode() for k, v in scope.get("headers", [])}
        url = headers.get(PREFILL_HEADER.lower())
        ok = url is not None and authorized(headers.get(SECRET_HEADER.lower()), self.secret)
        token = PREFILL_TARGET.set(url.rstrip("/") if ok else None)
        try:
            await self.app(scope, receive, send)
        finally:
            PREFILL_TARGET.reset(token)


def _pool_state(core) -> tuple[int, int, int, int]:
    """What a waiting reservation's chance depends on: free slots and pages, live sequences, the
    requests queued ahead of it."""
    return core.cache.kda.num_free, core.cache.mla.num_free, len(core.cache.seqs), len(core.scheduler.waiting)


def reserve_behind(core, ask: Ask, marker: int) -> Reservation | None:
    """`reserve`, once no request queued here before the reservation began waiting (a sequence id
    below `marker`: ids grow with arrival; preempted ones return to the queue's head) is still
    waiting: a reservation takes its place in the queue, never the pages those requests wait for."""
    if any(seq.seq_id < marker for seq in core.scheduler.waiting):
        return None
    return reserve(core, ask.tokens, None, ask.spans, ask.n)


def _drop(core, res: Reservation) -> None:
    cancel(core, res.seq_id, res.forks)


def _drop_plan(core, planned: tuple) -> None:
    """A `_plan` whose caller went away: free the reservation it made, if it made one."""
    if isinstance(planned[0], Reservation):
        _drop(core, planned[0])


class DecodeHandoff:
    def __init__(
        self,
        engine: AsyncEngine,
        ranks: InstanceRanks,
        secret: str,
        on_failure: str = "recompute",
        local_prefill_tokens: int = 0,
        timeout_s: float = 300.0,
        share_mla: bool = True,
    ):
        if on_failure not in ("recompute", "error"):
            raise ValueError("on_failure must be 'recompute' or 'error'")
        self.engine, self.ranks, self.secret = engine, ranks, secret
        self.cache = engine.core.cache
        self.fingerprint = handoff_fingerprint(self.cache, ranks.world)
        self.on_failure, self.local_prefill_tokens = on_failure, local_prefill_tokens
        self.timeout_s, self.share_mla = timeout_s, share_mla
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(timeout_s, connect=5.0))
        self.counters: Counter[str] = Counter()
        self.bypasses: Counter[str] = Counter()  # requests computed here, not handed off, by reason
        self.tamper: Callable[[str, object], object] | None = None
        self._background: set[asyncio.Task] = set()

    def _plan(self, core, ids: list[int], params, images) -> tuple[Reservation | int | None, int, Ask | None]:
        """On the engine thread: (a reservation; or the joint hit length if the request runs
        here; or REFUSED (the local way answers the refusal) or IMAGE_AT_END; or None while the
        pools are short or requests queued before it wait, and the caller waits behind them;
        the next sequence id, the arrival mark of `reserve_behind`; the request's `Ask`)."""
        try:
            ask = ask_of(core, ids, params, images)
        except InvalidRequestError:
            return REFUSED, core._next_seq, None
        if last_in_image(len(ask.tokens), ask.spans):
            return IMAGE_AT_END, core._next_seq, ask
        if self.local_prefill_tokens and core.cache.prefix_enabled:
            hit = core.cache.lookup(ask.tokens, spans=ask.spans)
            if len(ask.tokens) - hit.length <= self.local_prefill_tokens:
                return hit.length, core._next_seq, ask
        return reserve_behind(core, ask, core._next_seq), core._next_seq, ask

    async def _reserve(self, ids: list[int], params, images) -> tuple[Reservation | int, Ask | None]:
        """`_plan`; while the pools are short or earlier requests wait, a reservation queued on the
        engine thread (FIFO behind earlier reservations, after the requests queued before it,
        retried as running requests free slots and pages: the queueing a local request would
        see), or TIMED_OUT (run it locally) after the handoff timeout."""
        plan, marker, ask = await self.engine.call(
            lambda core: self._plan(core, ids, params, images), release=_drop_plan
        )
        if plan is not None:
            return plan, ask
        self.counters["reserve_waits"] += 1
        plan = await self.engine.call_when(
            lambda core: reserve_behind(core, ask, marker), _drop, self.timeout_s, key=_pool_state
        )
        return TIMED_OUT if plan is None else plan, ask

    async def submit(self, state, ids: list[int], params, images=None):
        url = PREFILL_TARGET.get()
        reason = bypass_reason(url, ids, params, images)
        if reason is not None:
            self.bypasses[reason] += 1
            return await state.submit_local(ids, params, images)
        plan, ask = await self._reserve(ids, params, images)
        if not isinstance(plan, Reservation):
            self.counters["local_prefills" if plan >= 0 else "local_other"] += 1
            self.counters["local_hit_tokens"] += max(plan, 0)
            self.bypasses[LOCAL_REASONS.get(plan, "local_prefill")] += 1
            return await state.submit_local(ids, params, images)
        try:
            await self._receive(url, ask, plan, images or [])
            if plan.forks:
                await self.engine.call(lambda core: fill_forks(core, plan))
        except (HandoffError, TransferError, httpx.HTTPError) as e:
            self.engine.post(lambda core: _drop(core, plan))
            reason = e.reason if isinstance(e, HandoffError) else type(e).__name__
            self.counters[f"failed_{reason}"] += 1
            self.counters["failures"] += 1
            if self.on_failure == "error":
                raise APIError(502, f"the prefill handoff failed ({reason}); nothing was generated", "server_error")
            self.counters["recomputes"] += 1
            self.bypasses["handoff_failed"] += 1
            return await state.submit_local(ids, params, images)
        except BaseException:
            self.engine.post(lambda core: _drop(core, plan))
            raise
        try:
            return await state.submit_local(ids, params, images, received=plan.seq_ids)
        except BaseException:
            self.engine.post(lambda core: _drop(core, plan))
            raise

    async def _post(self, url: str, path: str, msg, kind: type):
        r = await self.client.post(
            url + path, content=encode(msg), headers={SECRET_HEADER: self.secret, "content-type": MSGPACK}
        )
        if r.status_code != 200:
            raise HandoffError("prefill_refused", f"{path} answered {r.status_code}")
        try:
            return decode(r.content, kind)
        except (msgspec.DecodeError, msgspec.ValidationError):
            raise HandoffError("malformed_reply", f"{path} answered something that is not a {kind.__name__}") from None

    async def _receive(self, url: str, ask: Ask, res: Reservation, images: list) -> None:
        t0 = time.perf_counter()
        handoff_id = uuid.uuid4().hex
        packed = [pack_image(im) for im in images]
        msg = PrefillRequest(handoff_id, ask.tokens[:-1], res.start, None, packed, self.ranks.world)
        header = await self._post(url, "/disagg/prefill", msg, TransferHeader)
        released = False
        try:
            header = self._hook("header", header)
            self._verify(header, handoff_id, ask, res)
            plan = self._plan_reads(header, res)
            t_read = time.perf_counter()
            moved = await self.ranks.read(plan.reads, self.timeout_s)
            shared = await self._share_mla(res)
            self.counters["read_us"] += int((time.perf_counter() - t_read) * 1e6)
            self._hook("received", res)
            released = True
            ok = await self._post(url, "/disagg/release", Release(header.transfer_id, header.generation), ReleaseReply)
            if not ok.valid:
                raise HandoffError("stale_generation", "the prefill side no longer held this transfer")
            digests = await self.ranks.digests(plan.regions, plan.blocks, self.timeout_s)
            if digests != plan.expected:
                raise HandoffError("checksum_mismatch", "received bytes differ from the prefill side's")
        finally:
            if not released:
                task = asyncio.ensure_future(self._release_quietly(url, header))
                self._background.add(task)  # held until done (the loop keeps weak references only)
                task.add_done_callback(self._background.discard)
        mla = sum(r.length for r in res.regions if r.tensor == "mla") * (1 if self._sharing else self.ranks.world)
        c = self.counters
        c["bytes_mla_shared"] += shared
        c["handoffs"] += 1
        c["forks"] += len(res.forks)
        c["image_handoffs"] += bool(images)
        c["bytes_mla"] += mla
        c["bytes_kda"] += moved - mla
        c["hits"] += res.start > 0
        c["hit_tokens"] += res.start
        c["transfer_us"] += int((time.perf_counter() - t0) * 1e6)

    async def _release_quietly(self, url: str, header: TransferHeader) -> None:
        try:
            await self._post(url, "/disagg/release", Release(header.transfer_id, header.generation), ReleaseReply)
        except Exception:
            pass  # the prefill side frees it at its deadline

    @property
    def _sharing(self) -> bool:
        return self.share_mla and self.ranks.world > 1

    def _plan_reads(self, header: TransferHeader, res: Reservation):
        """Every rank's reads from the prefill instance: with `share_mla`, only rank 0 reads the
        MLA rows there (`_share_mla` gives them to the other ranks)."""
        mla = [r for r in res.regions if r.tensor == "mla"]
        source = (lambda r: 0 if r == 0 else None) if self._sharing else None
        try:
            return plan_reads(header, mla, self.cache.kda, res.slot, self.ranks.world, source)
        except (ValueError, KeyError, IndexError) as e:
            raise HandoffError("header_mismatch", str(e)) from None

    async def _share_mla(self, res: Reservation) -> int:
        """Ranks 1.. read the MLA rows rank 0 has just received from rank 0's own pools (through
        the instance's own transfer engines): the prefill instance sends them once per decode
        instance, not once per rank. Returns the bytes so copied."""
        mla = spans([r for r in res.regions if r.tensor == "mla"])
        if not self._sharing or not mla:
            return 0
        own = self.ranks.endpoints[0]
        remote = [(own.bases[t] + off, n) for t, _, off, n, _ in mla]
        reads = [[]] + [[RankRead(own.session, remote, mla)] for _ in range(1, self.ranks.world)]
        return await self.ranks.read(reads, self.timeout_s)

    def _hook(self, stage: str, obj):
        return self.tamper(stage, obj) if self.tamper is not None else obj

    def _verify(self, h: TransferHeader, handoff_id: str, ask: Ask, res: Reservation) -> None:
        ids = ask.tokens
        if h.request_id != handoff_id:
            raise HandoffError("header_mismatch", "the header answers another request")
        if h.fingerprint != self.fingerprint:
            raise HandoffError("fingerprint_mismatch", "the prefill instance's model or cache layout differs")
        if h.num_tokens != len(ids) - 1 or h.start != res.start:
            raise HandoffError("header_mismatch", "token count or start differ from the request's")
        if h.prefix_hash != prompt_hash(self.cache.model_id, None, ids[:-1], ask.digests):
            raise HandoffError("prefix_mismatch", "the prefill instance computed another prompt")
        if not h.ranks:
            raise HandoffError("header_mismatch", "the header names no prefill rank")
        if any(t not in src.bases for src in h.ranks for t, *_ in h.regions):
            raise HandoffError("header_mismatch", "a region names an unknown pool tensor")

    def router(self, render: Callable) -> APIRouter:
        """`render(state, path, body)`: the prompt ids a generation request would get (or None)."""
        r = APIRouter()

        add_match_route(r, self.engine, self.secret, render)

        @r.get("/disagg/state")
        async def state(request: Request):
            check_secret(request, self.secret)
            bypasses = {f"bypass_{k}": v for k, v in self.bypasses.items()}
            return await engine_state(self.engine, {"role": "decode", **self.counters, **bypasses})

        return r
