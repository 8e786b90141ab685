"""safetensors checkpoint -> `KimiForCausalLM` (spec/model.md §15-16).

- one file (`model.safetensors`) or shards listed in `model.safetensors.index.json`, memory-mapped;
- K3 text names live under `language_model.`; vision tensors are skipped with a log line;
- routed experts `…experts.{e}.w{1,2,3}.weight` (bf16) or `.weight_packed`/`.weight_scale`
  (MXFP4, recognised by suffix) are stacked into the layer's `experts.w{1,2,3}`;
- `A_log` arrives padded (K3, `[>=H]`, tail must be zero) or 4-D (`[1, 1, H, 1]`), stored `[H]`;
- tensors saved in fp32 stay fp32; every other floating tensor takes the requested dtype;
- missing, unexpected, duplicated, mis-shaped or non-floating tensors (and index entries whose
  shard lacks them) raise one `CheckpointError` listing all of them.
"""
from __future__ import annotations

import json
import logging
import re
from collections import defaultdict
from pathlib import Path

import torch
from safetensors import safe_open
from tqdm import tqdm

from ..ops.mxfp4 import mxfp4_decode, mxfp4_validate
from .config import ModelConfig
from .kimi import KimiForCausalLM

log = logging.getLogger(__name__)

_EXPERT = re.compile(r"^(model\.layers\.\d+\.block_sparse_moe\.experts)\.(\d+)\.(w[123])\."
                     r"(weight|weight_packed|weight_scale)$")
_SKIP_PREFIXES = ("vision_tower.", "mm_projector.")
_MAX_LISTED = 20


class CheckpointError(ValueError):
    """The checkpoint does not match the model its config describes."""


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


def _text_name(name: str, family: str) -> str | None:
    """Checkpoint name -> model parameter name; None for tensors the text model ignores
    (vision), "" for a K3 name outside `language_model.` (unexpected)."""
    if family == "kimi_k3":
        if name.startswith(_SKIP_PREFIXES):
            return None
        if not name.startswith("language_model."):
            return ""
        name = name[len("language_model."):]
        if name.startswith("layers."):  # older dumps drop the inner "model."
            name = "model." + name
    return name


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


MOE_WEIGHTS = ("auto", "packed", "dequantized")


def load_model(model_dir: str | Path, dtype: torch.dtype | str = torch.bfloat16,
               device: str | torch.device = "cpu", config: ModelConfig | None = None,
               progress: bool = True, moe_weights: str = "auto") -> KimiForCausalLM:
    """Build the model from `config.json` and load every text tensor. `moe_weights="packed"`
    keeps MXFP4 routed experts packed (a projection whose experts are all MXFP4); "dequantized"
    decodes them to `dtype` at load; "auto" packs for bf16 (where the native kernels decode in
    registers) and dequantizes otherwise (the PyTorch decode per GEMM would dominate)."""
    if moe_weights not in MOE_WEIGHTS:
        raise ValueError(f"moe_weights must be one of {MOE_WEIGHTS}, got {moe_weights!r}")
    model_dir = Path(model_dir)
    dtype = resolve_dtype(dtype)
    if moe_weights == "auto":
        moe_weights = "packed" if dtype == torch.bfloat16 else "dequantized"
    cfg = config or ModelConfig.from_pretrained(model_dir)
    with torch.device("meta"):
        model = KimiForCausalLM(cfg)
    params = dict(model.named_parameters())
    expected = {n: tuple(p.shape) for n, p in params.items()}
    files = checkpoint_files(model_dir)

    loaded: dict[str, torch.Tensor] = {}
    packed: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    experts: dict[tuple[str, str], dict[int, dict[str, torch.Tensor]]] = defaultdict(lambda: defaultdict(dict))
    unexpected, bad_shape, bad_dtype, bad_expert, duplicate, absent = [], [], [], [], [], []
    bad_names, skipped = set(), 0
    source: dict[str, str] = {}
    by_file: dict[Path, list[str]] = defaultdict(list)
    for name, path in files.items():
        by_file[path].append(name)
    bar = tqdm(total=len(files), desc="loading weights", unit="tensor", disable=not progress)
    for path, names in by_file.items():
        with safe_open(path, framework="pt", device="cpu") as f:
            held = set(f.keys())
            for raw_name in names:
                bar.update(1)
                if raw_name not in held:
                    absent.append(f"{raw_name} (index: {path.name})")
                    continue
                name = _text_name(raw_name, cfg.family)
                if name is None:
                    skipped += 1
                    continue
                if not name:
                    unexpected.append(raw_name)
                    continue
                m = _EXPERT.match(name)
                key = name if m is None else f"{m.group(1)}.{m.group(2)}.{m.group(3)}.{m.group(4)}"
                if key in source:
                    duplicate.append(f"{raw_name} (same parameter as {source[key]})")
                    continue
                source[key] = raw_name
                if m:
                    experts[(m.group(1), m.group(3))][int(m.group(2))][m.group(4)] = f.get_tensor(raw_name)
                    continue
                if name not in expected:
                    unexpected.append(raw_name)
                    continue
                t = f.get_tensor(raw_name)
                if not t.is_floating_point():
                    bad_dtype.append(f"{raw_name}: {t.dtype} (expected a floating dtype)")
                    bad_names.add(name)
                    continue
                if name.endswith(".A_log"):
                    t, problem = _normalise_a_log(t, cfg.kda.num_heads, raw_name)
                    if t is None:
                        bad_shape.append(problem)
                        bad_names.add(name)
                        continue
                if tuple(t.shape) != expected[name]:
                    bad_shape.append(f"{raw_name}: {tuple(t.shape)} != expected {expected[name]}")
                    bad_names.add(name)
                    continue
                loaded[name] = t.to(device=device, dtype=_target_dtype(t, dtype))
    bar.close()
    if skipped:
        log.info("skipped %d vision tensors (the vision tower is not served yet)", skipped)

    for (prefix, proj), per_expert in experts.items():
        name = f"{prefix}.{proj}"
        if name not in expected:
            unexpected.extend(f"{prefix}.{e}.{proj}" for e in sorted(per_expert))
            continue
        keep_packed = moe_weights == "packed" and all("weight_packed" in v for v in per_expert.values())
        stack = _stack_packed if keep_packed else _stack_experts
        stacked, problems = stack(name, per_expert, expected[name], dtype, device)
        bad_expert.extend(problems)
        if stacked is None:
            bad_names.add(name)
        elif keep_packed:
            packed[name] = stacked
        else:
            loaded[name] = stacked
    if cfg.tie_word_embeddings and "lm_head.weight" not in loaded and "model.embed_tokens.weight" in loaded:
        loaded["lm_head.weight"] = loaded["model.embed_tokens.weight"]

    missing = sorted(set(expected) - set(loaded) - set(packed) - bad_names)
    problems = (_report("missing", missing) + _report("unexpected", unexpected)
                + _report("duplicated", duplicate) + _report("mis-shaped", bad_shape)
                + _report("wrong-dtype", bad_dtype) + _report("invalid expert", bad_expert)
                + _report("absent from their shard", absent))
    if problems:
        raise CheckpointError(f"checkpoint {model_dir} does not match its config:\n" + "\n".join(problems))
    for name, tensor in loaded.items():
        module_name, _, attr = name.rpartition(".")
        setattr(model.get_submodule(module_name), attr, torch.nn.Parameter(tensor, requires_grad=False))
    for name, (codes, scales) in packed.items():
        module_name, _, attr = name.rpartition(".")
        model.get_submodule(module_name).set_packed(attr, codes, scales, dtype)
    model.train(False)  # inference mode
    return model


def _stack_experts(name, per_expert, shape, dtype, device):
    """Stack `{prefix}.{e}.{proj}` tensors into `[E, O, I]`; problems name the expert tensors."""
    num, out_dim, in_dim = shape
    prefix, _, proj = name.rpartition(".")
    problems = []
    if sorted(per_expert) != list(range(num)):
        absent = [f"{prefix}.{e}.{proj} (missing)" for e in sorted(set(range(num)) - set(per_expert))]
        extra = [f"{prefix}.{e}.{proj} (unexpected)" for e in sorted(set(per_expert) - set(range(num)))]
        return None, absent + extra
    out = torch.empty(shape, dtype=dtype, device=device)
    for e in range(num):
        parts, where = per_expert[e], f"{prefix}.{e}.{proj}"
        if sorted(parts) not in (["weight"], ["weight_packed", "weight_scale"]):
            problems.append(f"{where}: needs either 'weight' or both 'weight_packed' and 'weight_scale',"
                            f" got {sorted(parts)}")
            continue
        if "weight" in parts:
            w = parts["weight"]
            if not w.is_floating_point():
                problems.append(f"{where}.weight: {w.dtype} (expected a floating dtype)")
                continue
        else:
            try:
                w = mxfp4_decode(parts["weight_packed"], parts["weight_scale"], dtype)
            except ValueError as err:
                problems.append(f"{where}: {err}")
                continue
        if tuple(w.shape) != (out_dim, in_dim):
            problems.append(f"{where}: {tuple(w.shape)} != expected {(out_dim, in_dim)}")
            continue
        out[e] = w
    return (None if problems else out), problems


def _stack_packed(name, per_expert, shape, dtype, device):
    """Stack MXFP4 experts into (packed [E, O, I/2], scale [E, O, I/32]) uint8, validated."""
    num, out_dim, in_dim = shape
    prefix, _, proj = name.rpartition(".")
    if sorted(per_expert) != list(range(num)):
        return _stack_experts(name, per_expert, shape, dtype, device)
    codes = torch.empty(num, out_dim, in_dim // 2, dtype=torch.uint8, device=device)
    scales = torch.empty(num, out_dim, in_dim // 32, dtype=torch.uint8, device=device)
    problems = []
    for e in range(num):
        parts, where = per_expert[e], f"{prefix}.{e}.{proj}"
        if sorted(parts) != ["weight_packed", "weight_scale"]:
            problems.append(f"{where}: needs both 'weight_packed' and 'weight_scale', got {sorted(parts)}")
            continue
        try:
            rows, cols = mxfp4_validate(parts["weight_packed"], parts["weight_scale"])
        except ValueError as err:
            problems.append(f"{where}: {err}")
            continue
        if (rows, cols) != (out_dim, in_dim):
            problems.append(f"{where}: {(rows, cols)} != expected {(out_dim, in_dim)}")
            continue
        codes[e], scales[e] = parts["weight_packed"], parts["weight_scale"]
    return (None if problems else (codes, scales)), problems


def _report(kind: str, items: list[str]) -> list[str]:
    if not items:
        return []
    more = f" (+{len(items) - _MAX_LISTED} more)" if len(items) > _MAX_LISTED else ""
    return [f"{kind} tensors ({len(items)}): " + ", ".join(items[:_MAX_LISTED]) + more]


def resolve_dtype(dtype: torch.dtype | str) -> torch.dtype:
    """Accept torch dtypes or their names ("float32", "bfloat16", "fp32", "bf16")."""
    if isinstance(dtype, torch.dtype):
        if dtype not in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
            raise ValueError(f"unsupported dtype {dtype}")
        return dtype
    names = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
             "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16,
             "float64": torch.float64, "auto": torch.bfloat16}
    if dtype not in names:
        raise ValueError(f"unsupported dtype {dtype!r}; expected one of {sorted(names)}")
    return names[dtype]
