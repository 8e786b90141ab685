"""safetensors checkpoint -> `KimiForCausalLM` (spec/model.md §15-16), in three phases that
stream one tensor at a time (memory-mapped; the checkpoint is never held twice):

1. read (`_read_tensors`): one file (`model.safetensors`) or shards listed in
   `model.safetensors.index.json`; K3 text names live under `language_model.`; vision tensors are
   skipped unread with a log line; each text name is taken once.
2. map (`_map_tensors`): routed experts `…experts.{e}.w{1,2,3}.weight` (bf16) or
   `.weight_packed`/`.weight_scale` (MXFP4, recognised by suffix) are stacked into the layer's
   `experts.w{1,2,3}`; `A_log` arrives padded (K3, `[>=H]`, tail must be zero) or 4-D
   (`[1, 1, H, 1]`), stored `[H]`; tensors saved in fp32 stay fp32; every other floating tensor
   takes the requested dtype.
   Under tensor parallelism (`tp`) each rank reads only its chunk of every sharded tensor through
   `safe_open(...).get_slice` (A_log, H floats, is read whole and cut after its padding is
   stripped); expected shapes are the rank's (the model is built sharded). Under expert
   parallelism a rank reads only its own experts' tensors, whole, stacked by local index.
3. validate (`_validate`): missing, unexpected, duplicated, mis-shaped or non-floating tensors
   (and index entries whose shard lacks them) raise one `CheckpointError` listing all of them,
   whichever phase found them; the model receives nothing before this passes.

On CPU the validated weights then move into one transparent-huge-page arena (`huge_pages`), each
original freed once copied, unless they would not fit in the memory available (they stay mapped).
"""

from __future__ import annotations

import json
import logging
import re
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

import torch
from safetensors import safe_open
from tqdm import tqdm

from ..parallel import SINGLE, ParallelContext
from ..parallel.loading import ShardError, ShardReader
from .config import ModelConfig
from .expert_stacking import stack_experts, stack_packed
from .fused import prepare_model
from .huge_pages import place_weights
from .kimi import KimiForCausalLM

log = logging.getLogger(__name__)

EXPERT_NAME = re.compile(
    r"^(model\.layers\.\d+\.block_sparse_moe\.experts)\.(\d+)\.(w[123])\."
    r"(weight|weight_packed|weight_scale)$"
)
_SKIP_PREFIXES = ("vision_tower.", "mm_projector.")
_MAX_LISTED = 20
# problem kinds in the order the error lists them
_PROBLEM_KINDS = (
    "missing",
    "unexpected",
    "duplicated",
    "mis-shaped",
    "wrong-dtype",
    "invalid expert",
    "absent from their shard",
)
MOE_WEIGHTS = ("auto", "packed", "dequantized")

Problems = dict[str, list[str]]  # kind -> offending tensors, in the order found


class CheckpointError(ValueError):
    """The checkpoint does not match the model its config describes."""


def load_model(
    model_dir: str | Path,
    dtype: torch.dtype | str = torch.bfloat16,
    device: str | torch.device = "cpu",
    config: ModelConfig | None = None,
    progress: bool = True,
    moe_weights: str = "auto",
    tp: ParallelContext | None = None,
) -> KimiForCausalLM:
    """Build the model from `config.json` and load every text tensor. `moe_weights="packed"`
    keeps MXFP4 routed experts packed (a projection whose experts are all MXFP4); "dequantized"
    decodes them to `dtype` at load; "auto" packs for bf16 (where the native kernels decode in
    registers) and dequantizes otherwise (the PyTorch decode per GEMM would dominate). `tp`:
    build and load this tensor-parallel rank's shard (None: the whole model, as one process)."""
    if moe_weights not in MOE_WEIGHTS:
        raise ValueError(f"moe_weights must be one of {MOE_WEIGHTS}, got {moe_weights!r}")
    model_dir = Path(model_dir)
    dtype = resolve_dtype(dtype)
    if moe_weights == "auto":
        moe_weights = "packed" if dtype == torch.bfloat16 else "dequantized"
    cfg = config or ModelConfig.from_pretrained(model_dir)
    with torch.device("meta"):
        model = KimiForCausalLM(cfg, tp)
    expected = {n: tuple(p.shape) for n, p in model.named_parameters()}
    shards = ShardReader.of(model, tp or SINGLE, _expert_stack)
    problems: Problems = {kind: [] for kind in _PROBLEM_KINDS}
    tensors = _read_tensors(model_dir, cfg.family, progress, problems, shards)
    try:
        mapped = _map_tensors(tensors, expected, cfg.kda.num_heads, dtype, device, moe_weights, problems, shards)
    except ShardError as err:
        raise CheckpointError(str(err)) from None
    weights: dict = _validate(mapped, expected, cfg.tie_word_embeddings, problems, model_dir)
    weights.update({(name, part): t for name, pair in mapped.packed.items() for part, t in enumerate(pair)})
    del mapped  # the weights are held only by `weights` now, so placing them frees each original
    if torch.device(device).type == "cpu":
        place_weights(weights)
    _install(model, weights, dtype)
    model.train(False)  # inference mode
    prepare_model(model)
    return model


def _expert_stack(name: str) -> str | None:
    """The stacked parameter (`…experts.w1`) one routed expert's tensor joins, else None."""
    m = EXPERT_NAME.match(name)
    return None if m is None else f"{m.group(1)}.{m.group(3)}"


# --- phase 1: read -------------------------------------------------------------------------------


def checkpoint_files(model_dir: Path) -> dict[str, Path]:
    """Tensor name -> file that holds it."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise CheckpointError(f"{index}: malformed index ({e})") from None
        files = {name: model_dir / fname for name, fname in weight_map.items()}
        absent = sorted({str(p.name) for p in files.values() if not p.is_file()})
        if absent:
            raise CheckpointError(f"{index} names missing shard files: {absent}")
        return files
    single = model_dir / "model.safetensors"
    if single.is_file():
        with safe_open(single, framework="pt") as f:
            return {name: single for name in f.keys()}
    raise CheckpointError(f"no model.safetensors or model.safetensors.index.json in {model_dir}")


def text_name(name: str, family: str) -> str | None:
    """Checkpoint name -> model parameter name; None for tensors the text model ignores
    (vision), "" for a K3 name outside `language_model.` (unexpected)."""
    if family == "kimi_k3":
        if name.startswith(_SKIP_PREFIXES):
            return None
        if not name.startswith("language_model."):
            return ""
        name = name[len("language_model.") :]
        if name.startswith("layers."):  # older dumps drop the inner "model."
            name = "model." + name
    return name


_WHOLE = ShardReader()


def _read_tensors(
    model_dir: Path, family: str, progress: bool, problems: Problems, shards: ShardReader = _WHOLE
) -> Iterator[tuple[str, str, Callable[[], torch.Tensor]]]:
    """Yield (checkpoint name, text name, read) once per text name, shard by shard while its file
    is open; `read()` memory-maps that tensor, so one nobody reads is never touched. Vision tensors
    are counted and skipped unread; index entries their shard lacks, K3 names outside
    `language_model.` and repeats of a text name go to `problems`. Index errors raise at once."""
    files = checkpoint_files(model_dir)
    by_file: dict[Path, list[str]] = defaultdict(list)
    for name, path in files.items():
        by_file[path].append(name)
    source: dict[str, str] = {}
    skipped = 0
    bar = tqdm(total=len(files), desc="loading weights", unit="tensor", disable=not progress)
    for path, names in by_file.items():
        with safe_open(path, framework="pt", device="cpu") as f:
            held = set(f.keys())
            for raw_name in names:
                bar.update(1)
                if raw_name not in held:
                    problems["absent from their shard"].append(f"{raw_name} (index: {path.name})")
                    continue
                name = text_name(raw_name, family)
                if name is None:
                    skipped += 1
                elif not name:
                    problems["unexpected"].append(raw_name)
                elif name in source:
                    problems["duplicated"].append(f"{raw_name} (same parameter as {source[name]})")
                else:
                    source[name] = raw_name
                    yield raw_name, name, shards.reader(f, raw_name, name)
    bar.close()
    if skipped:
        log.info("skipped %d vision tensors (the vision tower loads them: model/vision_weights.py)", skipped)


# --- phase 2: map --------------------------------------------------------------------------------


@dataclass
class _Mapped:
    """Parameter name -> tensor, as phase 2 leaves them (plain tensors not yet validated)."""

    # (checkpoint name, tensor, A_log problem or ""): floating tensors in their load dtype on the
    # device, anything else as read
    plain: dict[str, tuple[str, torch.Tensor, str]] = field(default_factory=dict)
    stacked: dict[str, torch.Tensor] = field(default_factory=dict)  # dense experts, checked
    packed: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)  # MXFP4, checked
    rejected: set[str] = field(default_factory=set)  # expert stacks whose problems are recorded


def _map_tensors(
    tensors: Iterator[tuple[str, str, Callable[[], torch.Tensor]]],
    expected: dict[str, tuple],
    heads: int,
    dtype: torch.dtype,
    device: str | torch.device,
    moe_weights: str,
    problems: Problems,
    shards: ShardReader = _WHOLE,
) -> _Mapped:
    """Checkpoint tensors -> module parameters. Plain tensors are read and converted one at a time
    as they stream in; routed expert tensors are gathered (still memory-mapped) and stacked per
    projection once the stream ends (MXFP4 kept packed where `moe_weights` says so). Names with no
    parameter go to problems["unexpected"] unread; stacking problems to "invalid expert"."""
    mapped = _Mapped()
    experts: dict[tuple[str, str], dict[int, dict[str, torch.Tensor]]] = defaultdict(lambda: defaultdict(dict))
    for raw_name, name, read in tensors:
        m = EXPERT_NAME.match(name)
        if m:
            e = int(m.group(2))
            if not shards.held_elsewhere(f"{m.group(1)}.{m.group(3)}", e):
                experts[(m.group(1), m.group(3))][e][m.group(4)] = read()
        elif name not in expected:
            problems["unexpected"].append(raw_name)
        else:
            mapped.plain[name] = (raw_name, *_map_plain(read(), name, raw_name, heads, dtype, device, shards))
    for (prefix, proj), per_expert in experts.items():
        name = f"{prefix}.{proj}"
        if name not in expected:
            problems["unexpected"].extend(f"{prefix}.{e}.{proj}" for e in sorted(per_expert))
            continue
        keep_packed = moe_weights == "packed" and all("weight_packed" in v for v in per_expert.values())
        stack = stack_packed if keep_packed else stack_experts
        held = shards.experts_held(name)
        stacked, found = stack(name, per_expert, expected[name], dtype, device, first=held.start if held else 0)
        problems["invalid expert"].extend(found)
        if stacked is None:
            mapped.rejected.add(name)
        else:
            (mapped.packed if keep_packed else mapped.stacked)[name] = stacked
    return mapped


def _map_plain(
    t: torch.Tensor,
    name: str,
    raw_name: str,
    heads: int,
    dtype: torch.dtype,
    device: str | torch.device,
    shards: ShardReader = _WHOLE,
) -> tuple[torch.Tensor, str]:
    """(the tensor as its parameter holds it, "") or (t as read, why its A_log is malformed).
    Non-floating tensors pass through as read, for validation to reject. `heads` is the model's
    whole KDA head count (an A_log is checked whole, then cut to this rank's heads)."""
    if not t.is_floating_point():
        return t, ""
    if name.endswith(".A_log"):
        a_log, problem = _normalise_a_log(t, heads, raw_name)
        if a_log is None:
            return t, problem
        t = shards.local(name, a_log)
    return t.to(device=device, dtype=_target_dtype(t, dtype)), ""


def _normalise_a_log(t: torch.Tensor, heads: int, name: str) -> tuple[torch.Tensor | None, str]:
    """(A_log as [heads], "") or (None, the problem)."""
    if t.dim() == 4 and t.shape[0] == t.shape[1] == t.shape[3] == 1:
        t = t.reshape(-1)
    if t.dim() != 1 or t.shape[0] < heads:
        return None, f"{name}: A_log shape {tuple(t.shape)} does not hold {heads} heads"
    if t.shape[0] > heads and torch.any(t[heads:] != 0):
        return None, f"{name}: A_log padding beyond {heads} heads is not zero"
    return t[:heads], ""


def _target_dtype(t: torch.Tensor, dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if t.dtype == torch.float32 else dtype


# --- phase 3: validate ---------------------------------------------------------------------------


def _validate(
    mapped: _Mapped, expected: dict[str, tuple], tie_word_embeddings: bool, problems: Problems, model_dir: Path
) -> dict[str, torch.Tensor]:
    """Each plain tensor must be floating, then (A_log) well-formed, then of its parameter's shape;
    every parameter must be loaded or rejected (a tied `lm_head.weight` may take a valid
    embedding). Returns the dense parameters to install; raises one `CheckpointError` naming
    every problem of every phase, by kind, if there is any."""
    params: dict[str, torch.Tensor] = {}
    for name, (raw_name, t, problem) in mapped.plain.items():
        if not t.is_floating_point():
            problems["wrong-dtype"].append(f"{raw_name}: {t.dtype} (expected a floating dtype)")
        elif problem:
            problems["mis-shaped"].append(problem)
        elif tuple(t.shape) != expected[name]:
            problems["mis-shaped"].append(f"{raw_name}: {tuple(t.shape)} != expected {expected[name]}")
        else:
            params[name] = t
    params.update(mapped.stacked)
    if tie_word_embeddings and "lm_head.weight" not in params and "model.embed_tokens.weight" in params:
        params["lm_head.weight"] = params["model.embed_tokens.weight"]
    problems["missing"] = sorted(set(expected) - set(params) - set(mapped.packed) - set(mapped.plain) - mapped.rejected)
    report = [line for kind in _PROBLEM_KINDS for line in _report(kind, problems[kind])]
    if report:
        raise CheckpointError(f"checkpoint {model_dir} does not match its config:\n" + "\n".join(report))
    return params


def _report(kind: str, items: list[str]) -> list[str]:
    if not items:
        return []
    more = f" (+{len(items) - _MAX_LISTED} more)" if len(items) > _MAX_LISTED else ""
    return [f"{kind} tensors ({len(items)}): " + ", ".join(items[:_MAX_LISTED]) + more]


def _install(model: KimiForCausalLM, weights: dict, dtype: torch.dtype) -> None:
    """Replace the meta parameters with the validated tensors: `weights[name]` a parameter,
    `weights[(name, 0)]` / `weights[(name, 1)]` the codes and scales of packed experts (`set_packed`)."""
    for name, tensor in weights.items():
        if isinstance(name, str):
            module_name, _, attr = name.rpartition(".")
            setattr(model.get_submodule(module_name), attr, torch.nn.Parameter(tensor, requires_grad=False))
        elif name[1] == 0:
            module_name, _, attr = name[0].rpartition(".")
            model.get_submodule(module_name).set_packed(attr, tensor, weights[(name[0], 1)], dtype)


def resolve_dtype(dtype: torch.dtype | str) -> torch.dtype:
    """Accept torch dtypes or their names ("float32", "bfloat16", "fp32", "bf16")."""
    if isinstance(dtype, torch.dtype):
        if dtype not in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
            raise ValueError(f"unsupported dtype {dtype}")
        return dtype
    names = {
        "float32": torch.float32,
        "fp32": torch.float32,
        "bfloat16": torch.bfloat16,
        "bf16": torch.bfloat16,
        "float16": torch.float16,
        "fp16": torch.float16,
        "float64": torch.float64,
        "auto": torch.bfloat16,
    }
    if dtype not in names:
        raise ValueError(f"unsupported dtype {dtype!r}; expected one of {sorted(names)}")
    return names[dtype]
