"""What a training run leaves beside its checkpoint: `training.json` (the config, steps, measured
training seconds, the machine, the loss every few steps) and the loss curve as an SVG polyline
(no plotting dependency)."""

from __future__ import annotations

import json
import math
import platform
import subprocess
from dataclasses import asdict
from pathlib import Path

import torch


def machine() -> dict:
    """CPU model and the ISA flags that matter for the kernels, torch version and threads."""
    model, flags = platform.processor(), []
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
        for line in out.splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "Model name":
                model = value.strip()
            elif key.strip() == "Flags":
                wanted = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile")
                flags = [f for f in value.split() if f in wanted]
    except (OSError, subprocess.SubprocessError):
        pass
    return {"cpu": model, "flags": flags, "torch": torch.__version__, "threads": torch.get_num_threads()}


def write_record(out_dir: Path, cfg, step: int, seconds: float, history: list[dict], every: int = 10) -> Path:
    last = history[-20:]
    record = {
        "config": asdict(cfg),
        "steps": step,
        "train_seconds": round(seconds, 1),
        "final_loss": round(sum(h["loss"] for h in last) / max(1, len(last)), 4),
        "machine": machine(),
        "loss": [[h["step"], h["loss"]] for h in history if h["step"] % every == 0 or h["step"] == step],
    }
    path = Path(out_dir) / "training.json"
    path.write_text(json.dumps(record, indent=1) + "\n")
    return path


def loss_svg(curves: dict[str, list[list[float]]], width: int = 640, height: int = 320) -> str:
    """An SVG of each named curve ([[step, loss], ...]) on log-scaled loss axes."""
    pad, colors = 40, ("#1f77b4", "#d62728", "#2ca02c", "#9467bd")
    pts = [p for c in curves.values() for p in c if p[1] > 0]
    x_max = max(p[0] for p in pts)
    lo, hi = math.log10(min(p[1] for p in pts)), math.log10(max(p[1] for p in pts))

    def xy(step, loss):
        x = pad + (width - 2 * pad) * step / x_max
        y = pad + (height - 2 * pad) * (hi - math.log10(max(loss, 1e-9))) / max(hi - lo, 1e-9)
        return f"{x:.1f},{y:.1f}"

    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-size="12">']
    parts.append(f'<rect width="{width}" height="{height}" fill="white"/>')
    for e in range(math.floor(lo), math.ceil(hi) + 1):
        for m in (1, 2, 5):
            v = m * 10**e
            if lo <= math.log10(v) <= hi:
                y = xy(0, v).split(",")[1]
                parts.append(f'<line x1="{pad}" x2="{width - pad}" y1="{y}" y2="{y}" stroke="#ddd"/>')
                parts.append(f'<text x="2" y="{y}">{v:g}</text>')
    for i, (name, c) in enumerate(curves.items()):
        color = colors[i % len(colors)]
        line = " ".join(xy(s, v) for s, v in c if v > 0)
        parts.append(f'<polyline fill="none" stroke="{color}" stroke-width="1.5" points="{line}"/>')
        parts.append(f'<text x="{width - pad - 180}" y="{pad + 16 * i}" fill="{color}">{name}</text>')
    parts.append(f'<text x="{width // 2 - 60}" y="{height - 8}">step (max {x_max})</text>')
    parts.append(f'<text x="{pad}" y="16">training loss (answer tokens, log scale)</text></svg>')
    return "\n".join(parts) + "\n"


def main(argv: list[str] | None = None) -> int:
    """`python -m deltaserve.train.record OUT.svg MODEL_DIR...`: plot the runs' loss curves."""
    import sys

    out, *dirs = argv if argv is not None else sys.argv[1:]
    curves = {}
    for d in dirs:
        rec = json.loads((Path(d) / "training.json").read_text())
        curves[f"{rec['config']['family']} ({rec['train_seconds'] / 60:.0f} min)"] = rec["loss"]
    Path(out).write_text(loss_svg(curves))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
