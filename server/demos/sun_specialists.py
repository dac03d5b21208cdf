"""The SUN demo's specialists: prefill-only LoRA adapters over one tiny base, tuned once and cached.

A tiny llama (2 layers, d=64) is trained from scratch on copying strings; then for each task --
rotate, reverse, sort (export/tasks.py) -- a rank-8 adapter is tuned against the frozen fp32 base
decoder (SUN-LoRA: 1000 steps at lr 1e-2; adapters want a larger step than full copies, whose
demo used 3e-3) and re-tuned 100 steps at lr 1e-3 against the int4 decoder (QSUN-LoRA): the
adapters the demo serves. The base row (no adapter) shows what the adapters add. Everything is
kept in --work (export/sun_eval_lora.py resumes and recomputes nothing finished). Real-model
adapters come from `edge-export tune --adapter lora` and benchmarks/sun/sun_accuracy.py.
"""
from __future__ import annotations

from pathlib import Path

from export.tune import TuneConfig

RANK = 8
_LORA = dict(mode="sun", adapter="lora", rank=RANK, alpha=2.0 * RANK, batch_size=64, seed=0)
SUN_LORA = TuneConfig(steps=1000, lr=1e-2, warmup=20, **_LORA)
QSUN_LORA = TuneConfig(decoder="int4", steps=100, lr=1e-3, warmup=0, **_LORA)
ROWS = ("base", "sun_lora", "qsun_lora")
SERVED = "qsun_lora"          # the adapters served: tuned for the int4 decoder


def make_specialists(work: Path, log=print) -> dict:
    """Train (or load, when cached) the base, the adapters, the table and the int4 decoder directory."""
    import torch

    from edge.model.lora.adapter import base_fingerprint
    from edge.model.sun_modules import load_module, save_module
    from export.sun_eval import TableConfig, accuracy_table, markdown_table, synthetic_base, synthetic_suite
    from export.sun_eval_lora import lora_table, lora_titles
    from export.tune import build_decoder, save_decoder
    work.mkdir(parents=True, exist_ok=True)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)                     # faster than 2 for a model this small
    try:
        if (work / "base" / "manifest.json").is_file():
            base = load_module(work / "base", dtype=torch.float32)[0]
        else:
            log("training the tiny base model from scratch (copying strings; ~15 s, once)")
            base = synthetic_base(steps=800, seed=0, progress=True)
            save_module(work / "base", base, {"kind": "synthetic-base"})
        tasks = synthetic_suite(n_train=20000, n_eval=200, seed=0)
        names = [t.name for t in tasks]
        if not all((work / "specialists" / n / SERVED / "manifest.json").is_file() for n in names):
            log(f"tuning the specialists as rank-{RANK} prefill-only adapters over the base: SUN-LoRA, then "
                f"QSUN-LoRA for the int4 decoder, for {' / '.join(names)} (~1 min of one core, once; cached in "
                f"{work})")
        accuracy_table(base, tasks, TableConfig(eval_batch=64), out_dir=work, progress=True, rows=("base",),
                       log=lambda s: None)
        res = lora_table(base, tasks, SUN_LORA, QSUN_LORA, out_dir=work, eval_batch=64, progress=True,
                         log=lambda s: None)
        if not (work / "decoder-int4" / "manifest.json").is_file():
            dec, fp = build_decoder(base, "int4")
            save_decoder(work / "decoder-int4", dec, "int4", fp, base_fingerprint=base_fingerprint(base))
    finally:
        torch.set_num_threads(threads)
    log("\nthe accuracy table (exact match on 200 held-out prompts per task):\n")
    log(markdown_table(res, ROWS, titles=lora_titles(RANK)))
    return {"tasks": tasks, "table": res, "base": work / "base", "decoder": work / "decoder-int4",
            "adapters": {n: work / "specialists" / n / SERVED for n in names}}
