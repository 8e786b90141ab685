"""`make_tiny`: a random-weight checkpoint in the real Hugging Face layout (spec/model.md §15-16):
`config.json`, `generation_config.json`, safetensors shards with `model.safetensors.index.json`,
the tokenizer files and (K3) `preprocessor_config.json` (§12.1). Invariants:

- Deterministic in `seed`: one generator, tensors drawn in `tensor_plan` order, independent of
  sharding; at least two shards, split at about equal byte counts.
- Routed expert weights are always MXFP4-representable (drawn, then `mxfp4_encode`d): with
  `mxfp4` they are stored packed (`weight_packed`/`weight_scale`), otherwise decoded to `dtype`
  as `.weight`, so the two variants of one seed define the same model exactly.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import torch
from safetensors.torch import save_file

from ..model.image_processor import PROCESSOR_FILE
from ..ops.mxfp4 import GROUP_SIZE, mxfp4_decode, mxfp4_encode
from .hf_config import hf_config
from .plan import Entry, tensor_plan
from .presets import FAMILIES, MEDIA_PROC_CFG, PRESETS
from .tokenizer import EOS_NAME, NUM_RESERVED, ranks_file_size, write_tokenizer

_DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float32: "float32", torch.float16: "float16"}


def param_count(family: str, preset: str = "tiny") -> int:
    """Logical parameter count of a preset (text and vision, experts unpacked)."""
    return sum(math.prod(e.shape) for e in tensor_plan(family, PRESETS[(family, preset)]))


def make_tiny(
    out_dir: str | Path,
    family: str,
    preset: str = "tiny",
    mxfp4: bool | None = None,
    seed: int = 0,
    dtype: torch.dtype = torch.bfloat16,
    vision: bool | None = None,
    tokenizer_ranks: str | Path | None = None,
) -> Path:
    """Write a random-weight checkpoint of `family` at `preset` size into `out_dir` and return
    it. `mxfp4=None` takes the preset's default (tiny: bf16 experts, K3 mini: MXFP4). `vision`
    (K3 only; None: on for K3) adds the vision tower, its `vision_config` and the processor config.
    `tokenizer_ranks` (a tiktoken base-rank file, e.g. Moonshot's Kimi ranks) replaces the default
    cl100k_base prefix; the vocabulary (embedding, lm_head) grows to its size + 256 so prompt
    token counts equal the real model's."""
    if (family, preset) not in PRESETS:
        raise ValueError(f"unknown family/preset {family!r}/{preset!r}; families {FAMILIES}, presets ('tiny', 'mini')")
    if dtype not in _DTYPE_NAMES:
        raise ValueError(f"unsupported dtype {dtype}")
    vision = family == "kimi_k3" if vision is None else vision
    if vision and family != "kimi_k3":
        raise ValueError("only kimi_k3 has a vision tower")
    d = PRESETS[(family, preset)]
    if tokenizer_ranks is not None:
        d = dataclasses.replace(d, vocab=ranks_file_size(Path(tokenizer_ranks)) + NUM_RESERVED)
    mxfp4 = d.mxfp4 if mxfp4 is None else mxfp4
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    ids = write_tokenizer(out, family, d.vocab, 1 << 20, tokenizer_ranks, d.single_digits, d.bare_words)
    cfg = hf_config(family, d, ids, mxfp4, _DTYPE_NAMES[dtype], vision)
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    gen_cfg = {"bos_token_id": ids["[BOS]"], "eos_token_id": ids[EOS_NAME[family]], "pad_token_id": ids["[PAD]"]}
    (out / "generation_config.json").write_text(json.dumps(gen_cfg, indent=2) + "\n")
    if vision:
        write_processor_config(out)
    _write_shards(out, tensor_plan(family, d, vision), d.shard_bytes, seed, dtype, mxfp4)
    return out


def _write_shards(out: Path, plan: list[Entry], shard_bytes: int, seed: int, dtype: torch.dtype, mxfp4: bool) -> None:
    """Draw every tensor of `plan` in order and save them as shards plus their index."""
    shard_of = _shards([_nbytes(e, dtype, mxfp4) for e in plan], shard_bytes)
    n = max(shard_of) + 1
    g = torch.Generator().manual_seed(seed)
    weight_map, total = {}, 0
    for k in range(n):
        fname = f"model-{k + 1:05d}-of-{n:05d}.safetensors"
        tensors = {}
        for e, s in zip(plan, shard_of):
            if s == k:
                tensors.update(_materialise(e, g, dtype, mxfp4))
        save_file(tensors, str(out / fname), metadata={"format": "pt"})
        for name, t in tensors.items():
            weight_map[name] = fname
            total += t.numel() * t.element_size()
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def _nbytes(e: Entry, dtype: torch.dtype, mxfp4: bool) -> int:
    n = math.prod(e.shape)
    if e.expert and mxfp4:
        return n // 2 + n // GROUP_SIZE
    return n * (4 if e.fp32 else torch.empty((), dtype=dtype).element_size())


def _materialise(e: Entry, g: torch.Generator, dtype: torch.dtype, mxfp4: bool) -> dict[str, torch.Tensor]:
    w = e.init(g, e.shape).float()
    if e.expert:
        packed, scale = mxfp4_encode(w)
        if mxfp4:
            return {e.name + ".weight_packed": packed, e.name + ".weight_scale": scale}
        return {e.name + ".weight": mxfp4_decode(packed, scale, dtype)}
    return {e.name: w if e.fp32 else w.to(dtype)}


def _shards(sizes: list[int], limit: int) -> list[int]:
    """Shard index per entry: consecutive runs of about total/n bytes, n = max(2, total/limit)."""
    total = sum(sizes)
    n = min(len(sizes), max(2, math.ceil(total / limit)))
    out, acc = [], 0
    for s in sizes:
        out.append(min(n - 1, acc * n // total))
        acc += s
    ranks = {k: r for r, k in enumerate(sorted(set(out)))}
    out = [ranks[k] for k in out]
    if max(out) == 0:  # one tensor dominates: split off the last entry
        out[-1] = 1
    return out


def write_processor_config(out: str | Path) -> None:
    """K3's `preprocessor_config.json` (the spec's `media_proc_cfg` values) into `out`."""
    (Path(out) / PROCESSOR_FILE).write_text(json.dumps({"media_proc_cfg": MEDIA_PROC_CFG}, indent=2) + "\n")
