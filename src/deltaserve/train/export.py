"""Start and finish of training: a fresh model from a `make_tiny` checkpoint (its random weights,
config, tokenizer and, for K3, vision tower), and the trained weights written back in that
checkpoint's exact layout (names, shapes, dtypes, shards; routed experts MXFP4-packed where the
preset stores them so), so every loader that reads a `make_tiny` checkpoint reads the result.

`mxfp4_roundtrip` is the quantisation the export applies to routed experts; training applies the
same in its last phase (`Trainer` with `qat_from`), so the exported model is the one it learned."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from ..model.modules import OpsModule
from ..model.weights import EXPERT_NAME, load_model, text_name
from ..ops.backends.torch import REFERENCE
from ..ops.mxfp4 import mxfp4_decode, mxfp4_encode

# parameters the optimiser leaves alone (the aux-loss-free routing bias is not a gradient target)
FROZEN = (".e_score_correction_bias",)


def trainable_model(model_dir: Path) -> torch.nn.Module:
    """The checkpoint's text model in fp32 on the reference (autograd) ops, in training mode."""
    model = load_model(model_dir, dtype=torch.float32, progress=False, moe_weights="dequantized")
    for m in model.modules():
        if isinstance(m, OpsModule):
            m.ops, m.prepared = REFERENCE, None
    model.train(True)
    for name, p in model.named_parameters():
        p.requires_grad_(not name.endswith(FROZEN))
    return model


def expert_params(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The stacked routed-expert weights ([E, out, in]: the MXFP4-stored tensors)."""
    return [p for n, p in model.named_parameters() if re.search(r"\.experts\.w[123]$", n)]


def mxfp4_roundtrip(w: torch.Tensor) -> torch.Tensor:
    """`w` ([..., in], in a multiple of 32) as MXFP4 stores it: decode(encode(w)), fp32."""
    flat = w.detach().float().reshape(-1, w.shape[-1])
    return mxfp4_decode(*mxfp4_encode(flat), torch.float32).reshape(w.shape)


def export(model: torch.nn.Module, template_dir: Path, out_dir: Path, family: str) -> Path:
    """Write `model`'s weights into a copy of `template_dir` (the checkpoint training started from)
    at `out_dir`, every tensor at its template name, shape and dtype."""
    template_dir, out_dir = Path(template_dir), Path(out_dir)
    params = {n: p.detach().float() for n, p in model.named_parameters()}
    out_dir.mkdir(parents=True, exist_ok=True)
    for f in template_dir.iterdir():
        if f.is_file() and f.suffix != ".safetensors":
            shutil.copy2(f, out_dir / f.name)
    index = json.loads((template_dir / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    total = 0
    for fname in files:
        tensors = {}
        with safe_open(str(template_dir / fname), framework="pt") as f:
            for name in f.keys():
                tensors[name] = _trained(name, f.get_tensor(name), params, family)
                total += tensors[name].numel() * tensors[name].element_size()
        save_file(tensors, str(out_dir / fname), metadata={"format": "pt"})
    index["metadata"]["total_size"] = total
    (out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return out_dir


def _trained(name: str, old: torch.Tensor, params: dict[str, torch.Tensor], family: str) -> torch.Tensor:
    text = text_name(name, family)
    if not text:  # the vision tower and projector stay as they were
        return old
    m = EXPERT_NAME.match(text)
    if m is None:
        new = params[text].reshape(-1)
        if text.endswith(".A_log") and new.numel() < old.numel():  # stored zero-padded past the heads
            new = torch.cat([new, new.new_zeros(old.numel() - new.numel())])
        return new.reshape(old.shape).to(old.dtype).contiguous()
    w = params[f"{m.group(1)}.{m.group(3)}"][int(m.group(2))]
    if m.group(4) == "weight":
        return w.to(old.dtype).contiguous()
    packed, scale = mxfp4_encode(w)
    return packed if m.group(4) == "weight_packed" else scale
