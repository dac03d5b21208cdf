"""Keep the best step, judged on training pairs held back from it (`TuneConfig.select_every`).

A re-tune from a good start (QSUN from SUN, QSUN-LoRA from SUN-LoRA) can only lose when it overfits a
small training set: on Qwen2.5-Coder-0.5B's 378 tools pairs, 40 more steps against the int4 decoder
scored below the untouched start on it (issue 45). So `select_n` pairs are held back (a seeded draw,
never the task's held-out eval set), their answer CE through the decoder is measured before the first
step (step 0: the start as it is), every `select_every` steps and after the last, and the tuned module
ends at the step with the lowest CE. The best weights are kept beside the training checkpoint, so a
killed run resumes with them.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from export import tune_memory

BEST_FILE = "best.safetensors"
BEST_META = "best.json"


def hold_back(train: Sequence, n: int, seed: int) -> Tuple[list, list]:
    """(pairs to train on, `n` pairs to judge steps by): a seeded draw, the same on every resume."""
    if n <= 0:
        return list(train), []
    if n >= len(train):
        raise ValueError(f"cannot hold back {n} of {len(train)} training pairs for step selection: "
                         f"lower select_n")
    order = np.random.default_rng([seed, 7]).permutation(len(train))
    held = set(int(i) for i in order[:n])
    return [e for i, e in enumerate(train) if i not in held], [train[i] for i in sorted(held)]


@torch.no_grad()
def held_back_ce(loss_sum, model, decoder, pairs: Sequence, batch: int, device: str, bf16: bool) -> float:
    """Mean answer-token CE of `pairs` (loss_sum: export.tune.split_loss_sum), in eval mode."""
    was = model.training
    model.eval()
    total, count = 0.0, 0
    for i in range(0, len(pairs), batch):
        with tune_memory.autocast(device, bf16):
            s, c = loss_sum(model, decoder, pairs[i: i + batch])
        total, count = total + float(s), count + int(c)
    model.train(was)
    return total / max(1, count)


def _trainable(model) -> Dict[str, torch.nn.Parameter]:
    return {n: p for n, p in model.named_parameters() if p.requires_grad}


class BestStep:
    """The lowest held-back CE seen so far and the trainable weights at that step (in memory and, with
    `ck`, on disk beside the checkpoint)."""

    def __init__(self, ck: Optional[Path]):
        self.ck, self.step, self.ce, self.weights = ck, None, float("inf"), {}
        self.seen: List[dict] = []

    def load(self, model) -> None:
        """Resume: the best so far, as saved (nothing when no step was judged yet)."""
        if self.ck is None or not (self.ck / BEST_META).is_file():
            return
        meta = json.loads((self.ck / BEST_META).read_text())
        self.step, self.ce, self.seen = meta["step"], meta["ce"], meta["seen"]
        self.weights = load_file(str(self.ck / BEST_FILE))
        missing = set(_trainable(model)) - set(self.weights)
        if missing:
            raise ValueError(f"{self.ck / BEST_FILE} does not match the model (missing {sorted(missing)[:3]})")

    def judged(self, step: int) -> bool:
        return any(s["step"] == step for s in self.seen)

    def offer(self, step: int, ce: float, model) -> bool:
        """Record the CE at `step`; keep the weights when it is the lowest yet. True when kept."""
        self.seen.append({"step": step, "val_ce": round(ce, 5)})
        better = ce < self.ce
        if better:
            self.step, self.ce = step, ce
            self.weights = {n: p.detach().clone().contiguous() for n, p in _trainable(model).items()}
        if self.ck is not None:
            self.ck.mkdir(parents=True, exist_ok=True)
            if better:
                tmp = self.ck / (BEST_FILE + ".tmp")
                save_file(self.weights, str(tmp))
                tmp.replace(self.ck / BEST_FILE)
            (self.ck / BEST_META).write_text(json.dumps({"step": self.step, "ce": self.ce, "seen": self.seen}))
        return better

    def restore(self, model) -> dict:
        """Put the best step's weights back into `model`; what was picked, for the history."""
        params = _trainable(model)
        with torch.no_grad():
            for n, w in self.weights.items():
                params[n].copy_(w)
        return {"picked_step": self.step, "val_ce": round(self.ce, 5), "judged": list(self.seen)}
