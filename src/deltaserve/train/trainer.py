"""`deltaserve train-tiny`: train a small model of either family on the curriculum, on CPU.

The model is the engine's own `KimiForCausalLM` on the reference ops (autograd through them; no
engine, no cache), fp32, packed sequences (`cu_seqlens`), loss on answer tokens only. AdamW with
linear warmup and cosine decay; from `qat_from` of the steps on, routed experts are trained
through their MXFP4 rounding (forward and backward at the rounded weights, the update applied to
the fp32 master weights: a straight-through estimator), so the exported MXFP4 model is the one
that learned. Deterministic from the seed: step s draws its batch from (seed, s), and a resumed
run (state every `checkpoint_every` steps, safetensors + JSON, no pickle) continues the same
trajectory.

Layout of the output directory: `work/init` (the random starting checkpoint), `work/state.*`
(weights, optimiser moments, step, loss history), and the final checkpoint in `model/` with its
`training.json` (`record.write_record`).
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from tqdm import tqdm

from ..chat.render import load_chat_template
from ..model.context import ForwardContext
from ..model.tokenizer import Tokenizer
from ..tiny import make_tiny
from .curriculum import Batch, batches
from .export import expert_params, export, mxfp4_roundtrip, trainable_model
from .record import write_record
from .tasks import RECALL_TOKENS_PER_UNIT, tokens_per_unit


@dataclass
class TrainConfig:
    family: str = "kimi_k3"
    preset: str = "small"
    seed: int = 0
    steps: int = 1500
    tokens_per_step: int = 4096
    lr: float = 3e-3
    min_lr_ratio: float = 0.05
    warmup: int = 40
    weight_decay: float = 0.01
    qat_from: float = 0.75  # fraction of the steps after which experts train through MXFP4
    thinking_share: float = 0.5
    recall_max: int = 3072  # largest recall size trained (`tasks.recall`: ~4.8k tokens)
    recall_dialogue: bool = True  # ask several of a context's facts, one per turn (`tasks.recall`)
    checkpoint_every: int = 50

    def lr_at(self, step: int) -> float:
        if step < self.warmup:
            return self.lr * (step + 1) / self.warmup
        t = (step - self.warmup) / max(1, self.steps - self.warmup)
        return self.lr * (self.min_lr_ratio + (1 - self.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, t))))

    def recall_size(self, step: int) -> tuple[int, int]:
        """Recall sizes (`tasks.recall`) at `RECALL_TOKENS_PER_UNIT`: 256-1024 (~400-1600 tokens)
        for the first third, then 512 to `recall_max` (the trainer rescales them to its tokenizer)."""
        if step < self.steps // 3:
            return (256, 1024)
        return (512, self.recall_max)


class Trainer:
    def __init__(self, cfg: TrainConfig, out_dir: str | Path):
        self.cfg = cfg
        self.out = Path(out_dir)
        self.work = self.out / "work"
        init = self.work / "init"
        if not (init / "config.json").is_file():
            make_tiny(init, cfg.family, cfg.preset, seed=cfg.seed)
        self.init_dir = init
        self.model = trainable_model(init)
        self.tokenizer = Tokenizer.from_pretrained(init)
        self.template = load_chat_template(init)
        self.unit_tokens = tokens_per_unit(self.tokenizer.encode)
        self.params = {n: p for n, p in self.model.named_parameters() if p.requires_grad}
        decay = [p for p in self.params.values() if p.dim() >= 2]
        rest = [p for p in self.params.values() if p.dim() < 2]
        groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": rest, "weight_decay": 0.0}]
        self.opt = torch.optim.AdamW(groups, lr=cfg.lr, betas=(0.9, 0.95), eps=1e-8)
        self.experts = expert_params(self.model)
        self.step = 0
        self.history: list[dict] = []
        self.seconds = 0.0
        self._resume()

    def recall_size(self, step: int) -> tuple[int, int]:
        """`cfg.recall_size` rescaled so the contexts keep their token lengths on this tokenizer."""
        scale = RECALL_TOKENS_PER_UNIT / self.unit_tokens
        return tuple(max(4, round(x * scale)) for x in self.cfg.recall_size(step))

    # --- state ----------------------------------------------------------------------------------

    def _state_files(self) -> tuple[Path, Path]:
        return self.work / "state.safetensors", self.work / "state.json"

    def save_state(self) -> None:
        tensors, meta = {}, {"step": self.step, "config": asdict(self.cfg), "seconds": self.seconds}
        for name, p in self.params.items():
            tensors[name] = p.detach().contiguous()
            st = self.opt.state.get(p)
            if st:
                tensors[name + "::exp_avg"] = st["exp_avg"].contiguous()
                tensors[name + "::exp_avg_sq"] = st["exp_avg_sq"].contiguous()
                meta.setdefault("adam_steps", {})[name] = float(st["step"])
        st_file, meta_file = self._state_files()
        tmp = st_file.with_suffix(".tmp")
        save_file(tensors, str(tmp))
        tmp.replace(st_file)
        meta["history"] = self.history
        tmp = meta_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(meta))
        tmp.replace(meta_file)

    def _resume(self) -> None:
        st_file, meta_file = self._state_files()
        if not (st_file.is_file() and meta_file.is_file()):
            return
        meta = json.loads(meta_file.read_text())
        if meta["config"] != asdict(self.cfg):
            raise ValueError(f"{meta_file} was written by another training config: {meta['config']}")
        tensors = load_file(str(st_file))
        with torch.no_grad():
            for name, p in self.params.items():
                p.copy_(tensors[name])
                if name + "::exp_avg" in tensors:
                    self.opt.state[p] = {
                        "step": torch.tensor(meta["adam_steps"][name]),
                        "exp_avg": tensors[name + "::exp_avg"].clone(),
                        "exp_avg_sq": tensors[name + "::exp_avg_sq"].clone(),
                    }
        self.step, self.history, self.seconds = meta["step"], meta["history"], meta.get("seconds", 0.0)

    # --- steps ----------------------------------------------------------------------------------

    def loss(self, batch: Batch) -> torch.Tensor:
        h = self.model(batch.ids, ForwardContext(batch.cu_seqlens))
        sel = batch.targets >= 0
        logits = self.model.lm_head(h[sel]).float()
        return torch.nn.functional.cross_entropy(logits, batch.targets[sel])

    def train_step(self, batch: Batch) -> float:
        qat = self.step >= int(self.cfg.qat_from * self.cfg.steps)
        masters = [p.detach().clone() for p in self.experts] if qat else []
        if qat:
            with torch.no_grad():
                for p in self.experts:
                    p.copy_(mxfp4_roundtrip(p))
        for group in self.opt.param_groups:
            group["lr"] = self.cfg.lr_at(self.step)
        self.opt.zero_grad(set_to_none=True)
        loss = self.loss(batch)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(list(self.params.values()), 1.0)
        with torch.no_grad():
            for p, m in zip(self.experts, masters):
                p.copy_(m)
        self.opt.step()
        return loss.item()

    def run(self, progress: bool = True, until: int | None = None) -> Path | None:
        """Train to `cfg.steps` (from the saved state, if any) and export `out/model`; with `until`,
        stop after that step (state saved, no export: None)."""
        cfg = self.cfg
        data = batches(
            self.tokenizer,
            cfg.family,
            cfg.seed,
            cfg.tokens_per_step,
            cfg.thinking_share,
            self.recall_size,
            self.template,
            start_step=self.step,
            dialogue=cfg.recall_dialogue,
        )
        bar = tqdm(total=cfg.steps, initial=self.step, disable=not progress, desc=f"train {cfg.family}")
        smooth = None
        stop = cfg.steps if until is None else min(until, cfg.steps)
        while self.step < stop:
            t0 = time.perf_counter()
            batch = next(data)
            loss = self.train_step(batch)
            self.seconds += time.perf_counter() - t0
            self.step += 1
            self.history.append({"step": self.step, "loss": round(loss, 5), "seconds": round(self.seconds, 1)})
            smooth = loss if smooth is None else 0.95 * smooth + 0.05 * loss
            bar.set_postfix(loss=f"{smooth:.3f}", lr=f"{cfg.lr_at(self.step):.1e}")
            bar.update(1)
            if self.step % cfg.checkpoint_every == 0 or self.step == stop:
                self.save_state()
        bar.close()
        return self.export() if self.step == cfg.steps else None

    def export(self) -> Path:
        if self.cfg.qat_from < 1.0:
            with torch.no_grad():
                for p in self.experts:
                    p.copy_(mxfp4_roundtrip(p))
        out = export(self.model, self.init_dir, self.out / "model", self.cfg.family)
        write_record(out, self.cfg, self.step, self.seconds, self.history)
        return out
