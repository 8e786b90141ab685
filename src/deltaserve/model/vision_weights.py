"""safetensors checkpoint -> `VisionModel` (spec/model.md §12.2, §12.5).

Reads exactly the `vision_tower.*` and `mm_projector.*` tensors (one file or the shards of
`model.safetensors.index.json`), under the §12.2 names, which are the model's parameter names.
Missing, unexpected (vision-prefixed but unknown), mis-shaped or non-floating tensors, and
index entries their shard lacks, raise one `CheckpointError` listing all of them before the
model receives anything. Every tensor takes the requested dtype. The text loader
(`model.weights`) keeps skipping these tensors.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import torch
from safetensors import safe_open

from .vision import VisionConfig, VisionModel
from .weights import CheckpointError, checkpoint_files, resolve_dtype

PREFIXES = ("vision_tower.", "mm_projector.")
_MAX_LISTED = 20


def load_vision_model(
    model_dir: str | Path,
    dtype: torch.dtype | str = torch.bfloat16,
    device: str | torch.device = "cpu",
    config: VisionConfig | None = None,
) -> VisionModel:
    """Build the tower + projector from `config.json`'s `vision_config` and load its tensors."""
    model_dir = Path(model_dir)
    dtype = resolve_dtype(dtype)
    cfg = config or VisionConfig.from_pretrained(model_dir)
    with torch.device("meta"):
        model = VisionModel(cfg)
    expected = {n: tuple(p.shape) for n, p in model.named_parameters()}
    problems: dict[str, list[str]] = defaultdict(list)
    params: dict[str, torch.Tensor] = {}
    seen: set[str] = set()
    by_file: dict[Path, list[str]] = defaultdict(list)
    for name, path in checkpoint_files(model_dir).items():
        if name.startswith(PREFIXES):
            by_file[path].append(name)
    for path, names in by_file.items():
        with safe_open(path, framework="pt", device="cpu") as f:
            held = set(f.keys())
            for name in names:
                if name not in held:
                    problems["absent from their shard"].append(f"{name} (index: {path.name})")
                elif name not in expected:
                    problems["unexpected"].append(name)
                else:
                    seen.add(name)
                    t = f.get_tensor(name)
                    if not t.is_floating_point():
                        problems["wrong-dtype"].append(f"{name}: {t.dtype}")
                    elif tuple(t.shape) != expected[name]:
                        problems["mis-shaped"].append(f"{name}: {tuple(t.shape)} != expected {expected[name]}")
                    else:
                        params[name] = t.to(device=device, dtype=dtype)
    problems["missing"] = sorted(set(expected) - seen)
    report = [_report(kind, items) for kind, items in problems.items() if items]
    if report:
        raise CheckpointError(f"vision checkpoint {model_dir} does not match its vision_config:\n" + "\n".join(report))
    model.load_state_dict(params, strict=True, assign=True)
    for p in model.parameters():
        p.requires_grad_(False)
    return model.train(False)


def _report(kind: str, items: list[str]) -> str:
    more = f" (+{len(items) - _MAX_LISTED} more)" if len(items) > _MAX_LISTED else ""
    return f"{kind} tensors ({len(items)}): " + ", ".join(items[:_MAX_LISTED]) + more
