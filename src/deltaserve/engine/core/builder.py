"""`build_engine(config)`: model, tokenizer, cache layout, pools and `EngineCore` from one
`EngineConfig`, in the order start-up needs (used by `LLM` and, through it, the server).

Invariants: the native CPU kernels (bf16 only) are built and loaded before the pools are sized,
so no request pays for the compile; the cache's producer fingerprint names the kernel backend
("cpu-native" or "torch"), so checkpoints made by one backend never restore into the other.

A wide expert-parallel replica (`config.wide_expert_parallel`: data-parallel replicas with the
experts split over every rank of them) joins its replicas' group first: at TP 1 this process is
its one rank and builds an unsharded engine; at TP > 1 it spawns its TP workers as plain TP does
and every one of them joins the replicas' group (`ranks.join`). Its MoE layers exchange tokens
with the other replicas' ranks (`model.tp.ep_world` > 1; its steps must run in lock-step with
theirs: engine/core/lockstep.py).

Under tensor parallelism (`ranks.plan_ranks`) the workers are started first, every rank loads its
shard at the same time, and rank 0 sizes the pools and sends their counts (`Hello`) before any
step. K3 checkpoints with `vision_tower.*` tensors get their vision model (tower + projector, the
model dtype) on rank 0 only: rank 0 encodes images and sends the rows in each `Step`. A process
whose rank is not 0 (torchrun, a node other than 0) serves its rank inside
`build_engine` and exits when rank 0 shuts down: it never returns an engine.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from ...cache import CacheLayout, CacheManager, build_pools, size_layout
from ...cache.checkpoint_policy import CheckpointPolicy
from ...cache.slot_journal import SlotJournal
from ...cache.tiers.store import build_store, close_tiers
from ...model import KimiForCausalLM, resolve_dtype
from ...model.identity import checkpoint_identity
from ...model.tokenizer import Tokenizer
from ...model.vision import VisionModel
from ...model.vision_weights import PREFIXES, load_vision_model
from ...model.weights import checkpoint_files
from ...ops.backends.select import describe
from ...ops.operands import ServedShapes
from ...parallel import SINGLE, init_expert_parallel, leave_tensor_parallel
from ..config import EngineConfig
from ..exec.channel import ControlChannel
from ..exec.encoder_cache import EncoderCache
from ..exec.messages import PROTOCOL_VERSION, Hello, Shutdown
from ..exec.ranks import RankGroup, plan_ranks, rank_device
from ..exec.worker import load_rank_model, run_worker
from ..spec.config import SpecConfig
from ..spec.decoder import SpecDecoder
from ..spec.draft_model import DraftModelProposer
from .loop import EngineCore

log = logging.getLogger(__name__)


@dataclass
class Engine:
    """The parts of a started engine; `core` runs requests over `cache`."""

    config: EngineConfig
    model: KimiForCausalLM
    tokenizer: Tokenizer | None
    layout: CacheLayout
    cache: CacheManager
    core: EngineCore
    max_model_len: int
    kernel: str
    ranks: RankGroup | None = None
    rank_memory: list[dict[str, int]] | None = None  # per rank: RSS before / peak at load, weights
    channel: ControlChannel | None = None

    def shutdown(self) -> None:
        """Stop the other ranks (idempotent); a failed group's workers are killed instead. A wide-EP
        replica leaves its expert-parallel group (after its workers, whose control group it holds)."""
        close_tiers(self.cache)
        ranks, self.ranks = self.ranks, None
        if ranks is None:
            if self.model.tp.ep_world > 1:
                leave_tensor_parallel()
            return
        if ranks.failure is None:
            try:
                self.channel.send(Shutdown("engine shut down"))
            except Exception:
                ranks.kill()
        ranks.close()

    def kill(self) -> None:
        """Stop the other ranks without a collective (the engine thread may be inside a step): kill
        the local workers; the process group is left to the process's exit. Later `shutdown`s
        do nothing."""
        ranks, self.ranks = self.ranks, None
        if ranks is not None:
            ranks.kill()


def resolve_device(name: str) -> str:
    """`auto` -> `cuda` where torch sees a GPU, else `cpu`; a CUDA device on a machine without
    one is refused with a clear message (not a failure deep inside the first allocation)."""
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if torch.device(name).type == "cuda" and not torch.cuda.is_available():
        build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "CPU-only"
        raise ValueError(f"--device {name}: no CUDA device is available (torch {torch.__version__}, {build} build)")
    return name


def spec_config(c: EngineConfig) -> SpecConfig | None:
    """The parsed `speculative_config` (ValueError if bad), checked against the rest of `c`."""
    return SpecConfig.parse(c.speculative_config)


def build_engine(config: EngineConfig) -> Engine:
    c = dataclasses.replace(config, device=resolve_device(config.device))
    spec_config(c)
    if c.num_threads is not None:
        torch.set_num_threads(c.num_threads)
    dtype = resolve_dtype(c.dtype)
    plan = plan_ranks(c)
    ranks, tp, control = None, SINGLE, None
    if c.wide_expert_parallel and plan is None:  # one rank of the replicas' expert-parallel group (TP 1)
        if not c.data_parallel_init_method:
            raise ValueError("a wide expert-parallel replica needs data_parallel_init_method (its group's rendezvous)")
        tp, _ = init_expert_parallel(
            c.data_parallel_rank, c.data_parallel_size, c.data_parallel_init_method, c.device, c.distributed_timeout
        )
        try:
            return _build_rank0(c, dtype, None, tp, None)
        except BaseException:
            leave_tensor_parallel(failed=True)
            raise
    if plan is not None:
        ranks = RankGroup(plan, c)
        ranks.launch()  # the workers get `c` and choose their own GPUs
        try:
            c = dataclasses.replace(c, device=rank_device(c, plan.rank))
        except BaseException:
            ranks.abandon()
            raise
        tp, control = ranks.join()
        if tp.rank != 0:
            try:
                run_worker(c, tp, control)
            finally:
                ranks.close()
            raise SystemExit(0)
    try:
        return _build_rank0(c, dtype, ranks, tp, control)
    except BaseException:
        if ranks is not None:
            ranks.abandon()
        raise


def load_vision(c: EngineConfig, model: KimiForCausalLM, dtype: torch.dtype) -> VisionModel | None:
    """The checkpoint's vision model (K3 with vision tensors), else None."""
    if model.config.family != "kimi_k3" or not any(n.startswith(PREFIXES) for n in checkpoint_files(Path(c.model))):
        return None
    vision = load_vision_model(c.model, dtype, c.device)
    log.info("vision model loaded: %d layers, %d-wide", vision.cfg.num_layers, vision.cfg.hidden_size)
    return vision


def served_shapes(cfg, layout: CacheLayout, dtype: torch.dtype, tp) -> ServedShapes:
    """The dtypes and this rank's attention shapes that decide which kernels run (`ops.backends.select.describe`)."""
    gate = "" if not cfg.kda_layer_ids else "softplus" if cfg.kda.gate_lower_bound is None else "sigmoid"
    heads = tp.split(cfg.mla.num_heads, "MLA heads") if cfg.mla_layer_ids else 0
    m = cfg.mla
    width = max(m.qk_nope_head_dim + m.qk_rope_head_dim, m.v_head_dim)
    return ServedShapes(
        dtype, layout.kv_dtype, layout.state_dtype, heads, m.kv_lora_rank, m.qk_rope_head_dim, width, gate
    )


def image_encoder(c: EngineConfig, vision: VisionModel | None) -> EncoderCache | None:
    """The encoder cache of a vision model, its per-step patch budget given or sized from memory."""
    if vision is None:
        return None
    enc = EncoderCache(vision, c.encoder_cache_memory, c.max_encoder_patches_per_step)
    log.info("image encodes: at most %d patches of tower work per step", enc.patches_per_step)
    return enc


def _spec_decoder(c: EngineConfig, max_model_len: int, model: KimiForCausalLM, pages: int) -> SpecDecoder | None:
    """The speculative decoder of `c`; a draft model is loaded here, on rank 0 only (unsharded:
    it drafts, the target's ranks verify), its MLA pages at most the target's `pages` + one a sequence."""
    spec = spec_config(c)
    if spec is None:
        return None
    log.info("speculative decoding: %s, up to %d drafts a step", spec.method, spec.num_speculative_tokens)
    proposer = None
    if spec.method == "draft_model":
        proposer = DraftModelProposer.load(
            spec.model,
            model,
            c.model,
            max_num_seqs=c.max_num_seqs,
            max_model_len=max_model_len,
            k_max=spec.num_speculative_tokens,
            page_size=c.page_size,
            catchup_tokens=c.max_num_batched_tokens,
            max_pages=pages + c.max_num_seqs,
        )
        log.info(
            "draft model %s: %d B of KDA state and %d B a page of %d tokens per request",
            spec.model,
            proposer.slot_bytes,
            proposer.page_bytes,
            c.page_size,
        )
    return SpecDecoder(spec, max_model_len, c.prefix_match_unit if c.enable_prefix_caching else None, proposer)


def _build_rank0(c: EngineConfig, dtype, ranks, tp, control) -> Engine:
    model, memory = load_rank_model(c, tp)
    vision = load_vision(c, model, dtype)
    tokenizer = None if c.skip_tokenizer_init else Tokenizer.from_pretrained(c.model)
    cfg = model.config
    max_model_len = c.max_model_len or cfg.max_position_embeddings
    if max_model_len < 1:
        raise ValueError(f"max_model_len must be positive, got {max_model_len}")
    policy = CheckpointPolicy.parse(c.kda_checkpoint_policy, c.prefix_match_unit, c.kda_checkpoint_interval)
    layout = size_layout(
        cfg,
        c.kv_cache_memory,
        c.max_num_seqs,
        max_model_len,
        c.page_size,
        dtype,
        resolve_dtype(c.kv_state_dtype),
        c.checkpoint_fraction if c.enable_prefix_caching else 0.0,
        tp,
        c.device,
    )
    model_id = f"{checkpoint_identity(c.model)}:{dtype}"  # content, not path: copies on other hosts agree
    kernel = model.ops.name  # load_model bound the backend (and built the native kernels) once
    served = served_shapes(cfg, layout, dtype, tp)
    log.info("kernel backend: %s (%s on %s): %s", kernel, dtype, c.device, describe(model.ops, served))
    stack = getattr(getattr(model, "model", None), "prepared", None)
    if stack is not None:
        log.info("decode steps of up to %d rows: the whole layer stack in one native call", stack.max_rows)
    cache = CacheManager(*build_pools(cfg, layout, c.device, tp), policy=policy, model_id=model_id, kernel=kernel)
    if c.kv_offload_memory is not None or c.kv_disk_path is not None or c.kv_store is not None:
        tiers = (c.kv_offload_memory, c.kv_disk_path, c.kv_disk_size, tp.world, c.kv_store, c.kv_store_size)
        cache.attach_tier(build_store(cache, *tiers))
    core = EngineCore(
        model,
        tokenizer,
        cache,
        max_num_seqs=c.max_num_seqs,
        max_num_batched_tokens=c.max_num_batched_tokens,
        max_model_len=max_model_len,
        seed=c.seed,
        structured_thinking_budget=c.structured_thinking_budget,
        encoder=image_encoder(c, vision),
        max_image_patches=c.max_image_patches_per_request,
        spec=_spec_decoder(c, max_model_len, model, layout.num_pages),
    )
    channel = None
    if tp.world > 1:
        channel = ControlChannel(control)
        names = [str(d).removeprefix("torch.") for d in (layout.kv_dtype, layout.state_dtype)]
        channel.send(
            Hello(
                PROTOCOL_VERSION,
                layout.num_pages,
                layout.page_size,
                layout.num_slots,
                layout.num_checkpoint_slots,
                *names,
            )
        )
        journal = SlotJournal()
        cache.record(journal)
        core.runner.attach(channel, journal, ranks)
    return Engine(
        c,
        model,
        tokenizer,
        layout,
        cache,
        core,
        max_model_len,
        kernel,
        ranks,
        memory,
        channel,
    )
