"""Draw the shipped models' training loss (their `training.json` records) as a log-scale SVG.

    python scripts/plot_loss.py [OUT.svg]   (default docs/figures/train_loss.svg)

No plotting library: the figure is a few polylines, written as SVG text.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODELS = ROOT / "src/deltaserve/assets/models"
SERIES = (("kimi-k3-small-chat", "#1f77b4"), ("kimi-linear-small-chat", "#d62728"))
W, H, LEFT, RIGHT, TOP, BOTTOM = 640, 320, 40, 600, 40, 280
Y_MIN, Y_MAX = 0.01, 10.0
TICKS = (0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5)


def _y(loss: float) -> float:
    t = (math.log10(max(loss, Y_MIN)) - math.log10(Y_MIN)) / (math.log10(Y_MAX) - math.log10(Y_MIN))
    return BOTTOM - t * (BOTTOM - TOP)


def svg(records: list[tuple[str, str, dict]]) -> str:
    max_step = max(r["steps"] for _, _, r in records)
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" font-size="12">']
    out.append(f'<rect width="{W}" height="{H}" fill="white"/>')
    for v in TICKS:
        y = _y(v)
        out.append(f'<line x1="{LEFT}" x2="{RIGHT}" y1="{y:.1f}" y2="{y:.1f}" stroke="#ddd"/>')
        out.append(f'<text x="2" y="{y:.1f}">{v:g}</text>')
    for i, (name, color, rec) in enumerate(records):
        pts = " ".join(f"{LEFT + (RIGHT - LEFT) * s / max_step:.1f},{_y(loss):.1f}" for s, loss in rec["loss"])
        out.append(f'<polyline fill="none" stroke="{color}" stroke-width="1.5" points="{pts}"/>')
        minutes = round(rec["train_seconds"] / 60)
        threads = rec["machine"]["threads"]
        label = f"{rec['config']['family']} ({rec['steps']} steps, {minutes} min, threads {threads})"
        out.append(f'<text x="330" y="{40 + 16 * i}" fill="{color}">{label}</text>')
    out.append(f'<text x="260" y="{H - 8}">step (max {max_step})</text>')
    out.append('<text x="40" y="16">training loss (answer tokens, log scale)</text></svg>')
    return "\n".join(out) + "\n"


def main() -> int:
    dst = Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT / "docs/figures/train_loss.svg"
    records = [(n, c, json.loads((MODELS / n / "training.json").read_text())) for n, c in SERIES]
    dst.write_text(svg(records))
    print(dst)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
