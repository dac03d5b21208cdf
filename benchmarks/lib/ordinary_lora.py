"""An ordinary LoRA for llama-server's fair row in benchmarks/sun/sun_vs_multilora.py.

`edge-export tune --adapter lora` tunes a PREFILL-ONLY adapter: the loss is taken with the adapter
on the prompt and the bare base on the answer, because SUN decodes every task on the bare base.
llama-server applies an adapter to every token, so its own users would tune it the ordinary way:
the adapter on prompt and answer alike. This is that tuning, with everything else as the SUN run
of the same seed does it (export/tune.py): the same training pairs (BFCL tools, --max-len filter),
the same batches (rng(seed, step)), AdamW (0.9, 0.98), warmup then cosine to 10%, grad clip 1.0,
the same rank / alpha / targets / initialisation. Only the decoder differs: the trainee itself.

    python -m benchmarks.lib.ordinary_lora --seed 0 --out runs/sun_vs_multilora/tuned/ordinary-s0
"""
from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import numpy as np


def lr_at(lr: float, step: int, steps: int, warmup: int, min_frac: float = 0.1) -> float:
    """export/tune.py's schedule: linear warmup, then cosine down to lr * min_frac."""
    if step < warmup:
        return lr * (step + 1) / warmup
    t = (step - warmup) / max(1, steps - warmup)
    return lr * (min_frac + (1 - min_frac) * 0.5 * (1 + math.cos(math.pi * t)))


def tune_ordinary(base_name: str, out: Path, seed: int, steps: int, batch: int, lr: float, rank: int,
                  targets: str, max_len: int, threads: int) -> dict:
    import torch

    from edge.model.checkpoint import load_model
    from edge.model.lora.adapter import parse_targets
    from edge.model.lora.files import adapter_sha256, save_adapter
    from edge.model.reference import resolve_model
    from export.real_tasks import bfcl
    from export.tune import build_decoder, split_loss
    from export.tune_lora import make_trainee
    torch.set_num_threads(threads)
    torch.manual_seed(seed)
    src = resolve_model(base_name)
    model, ckpt = load_model(src)
    train = [e for e in bfcl(ckpt.tokenizer).train if len(e.prompt) + len(e.answer) <= max_len]
    frozen, base_fp = build_decoder(model, "fp32")
    trainee = make_trainee(frozen, rank, 2.0 * rank, parse_targets(targets), seed).train()
    opt = torch.optim.AdamW(trainee.parameters(), lr=lr, weight_decay=0.0, betas=(0.9, 0.98))
    warmup, t0, history = min(50, steps // 10), time.perf_counter(), []
    for step in range(steps):
        rng = np.random.default_rng([seed, step])
        rows = [train[i] for i in rng.integers(0, len(train), size=batch)]
        for g in opt.param_groups:
            g["lr"] = lr_at(lr, step, steps, max(1, warmup))
        loss = split_loss(trainee, trainee, rows)      # the adapter on prompt AND answer: ordinary LoRA
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trainee.parameters(), 1.0)
        opt.step()
        history.append({"step": step + 1, "loss": round(float(loss.detach()), 4)})
        print(f"step {step + 1}/{steps}: loss {history[-1]['loss']}", flush=True)
    ad = trainee.frozen_adapter()
    d = save_adapter(out, ad, base_model=str(src))
    man = {"kind": "lora", "applies_to": "every token (ordinary LoRA, benchmarks/lib/ordinary_lora.py)",
           "decoder_fingerprint": base_fp, "base_fingerprint": ad.base_fingerprint, "task": "tools",
           "base": str(src), "adapter": {"format": "peft-lora", "rank": ad.rank, "alpha": ad.alpha,
                                          "targets": list(ad.targets), "sha256": adapter_sha256(d)},
           "tune": {"seed": seed, "steps": steps, "batch_size": batch, "lr": lr, "max_len": max_len,
                    "train_examples": len(train), "train_s": round(time.perf_counter() - t0, 1)},
           "history": history}
    (d / "manifest.json").write_text(json.dumps(man, indent=1, sort_keys=True))
    return man


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", default="qwen2.5-coder-0.5b")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--batch-size", type=int, default=2)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--targets", default="q,k,v,o,gate,up,down")
    ap.add_argument("--max-len", type=int, default=320)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args(argv)
    man = tune_ordinary(a.base, a.out, a.seed, a.steps, a.batch_size, a.lr, a.rank, a.targets, a.max_len, a.threads)
    print(f"saved {a.out}: {man['tune']}")


if __name__ == "__main__":
    main()
