"""A short SUN-LoRA probe on a task's TRAINING pairs: per lr, the loss on held-back training pairs
after a few steps, and the seconds per step (issue 37 point 5: pick the adapter rows' lr, and size
a run before committing hours to it).

The held-out prompts are never touched: the last `held` training pairs are kept out of the probe's
training and its loss is measured on them (the same split loss the table's `ce` column uses).
"""
from __future__ import annotations

import time
from typing import Callable, Sequence

import torch

from export.tasks import TaskData
from export.tune import TuneConfig, build_decoder, split_loss, tune


def held_loss(prefill, decoder, pairs, batch: int = 8) -> float:
    with torch.no_grad():
        return sum(float(split_loss(prefill, decoder, pairs[i: i + batch])) * len(pairs[i: i + batch])
                   for i in range(0, len(pairs), batch)) / max(1, len(pairs))


def lr_probe(base, task: TaskData, lrs: Sequence[float], steps: int, rank: int, alpha: float,
             batch_size: int, held: int = 32, log: Callable[[str], None] = print) -> dict:
    """{"base_loss", "runs": [{"lr", "loss", "train_tail", "s_per_step"}]} for one task."""
    base = base.float().eval()
    dec, fp = build_decoder(base, "fp32")
    train, probe = task.train[:-held], task.train[-held:]
    t0 = time.perf_counter()
    out = {"task": task.name, "steps": steps, "held": len(probe), "base_loss": round(held_loss(dec, dec, probe), 4)}
    out["base_loss_s"] = round(time.perf_counter() - t0, 1)
    log(f"{task.name}: base loss on {len(probe)} held-back training pairs {out['base_loss']:.4f}")
    out["runs"] = []
    for lr in lrs:
        cfg = TuneConfig(mode="sun", adapter="lora", rank=rank, alpha=alpha, steps=steps, batch_size=batch_size,
                         lr=lr, warmup=max(1, steps // 10), max_new=task.max_new, stop_ids=task.stop_ids)
        res = tune(base, train, cfg, decoder=(dec, fp), progress=False)
        losses = [h["loss"] for h in res.history if "loss" in h]
        tail = losses[-5:]
        run = {"lr": lr, "loss": round(held_loss(res.prefill, dec, probe), 4),
               "train_tail": round(sum(tail) / len(tail), 4),
               "s_per_step": round(res.history[-1]["train_s"] / steps, 2)}
        out["runs"].append(run)
        log(f"{task.name} lr {lr:g}: held-back loss {run['loss']:.4f}, last-5 train loss {run['train_tail']:.4f}, "
            f"{run['s_per_step']:.1f} s/step")
    return out


def probe_markdown(model: str, probes: Sequence[dict], machine: str, threads: int) -> str:
    lines = [f"# SUN-LoRA probe, base {model}\n",
             "Loss on held-back TRAINING pairs (not the held-out prompts) after a short SUN-LoRA run per lr, "
             f"and seconds per training step (batch as run) on {machine}, {threads or 'default'} torch threads "
             "(a shared machine: times include contention).\n",
             "| task | steps | lr | held-back loss | last-5 train loss | s/step |", "|---|---:|---:|---:|---:|---:|"]
    for p in probes:
        lines.append(f"| {p['task']} | 0 | base | {p['base_loss']:.4f} | - | - |")
        lines += [f"| {p['task']} | {p['steps']} | {r['lr']:g} | {r['loss']:.4f} | {r['train_tail']:.4f} | "
                  f"{r['s_per_step']:.1f} |" for r in p["runs"]]
    return "\n".join(lines) + "\n"
