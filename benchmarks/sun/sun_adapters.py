"""SUN specialists as adapters in one worker vs full copies under the same memory (issue 37 point 6).

    .venv/bin/python -m benchmarks.sun.sun_adapters              # 8 and 64 tasks (~3 min on 2 shared cores)
    .venv/bin/python -m benchmarks.sun.sun_adapters --tasks 8 --requests 48
    nice -n 5 taskset -c 1 .venv/bin/python -m benchmarks.sun.sun_adapters --backend llamacpp --threads 1

A burst of requests (all at t=0; Zipf-skewed task popularity, s=1.1) of P-token prompts is prefilled
two ways on torch, measured here, one after the other in this one process:

* adapters: one worker, the base once plus one rank-16 LoRA adapter per task (all seven linears);
  it takes the B oldest rows of ANY tasks per call (edge.model.lora.lora_prefill, per-row gather);
* full copies: the same memory budget (base + T adapters) holds K = budget // model bytes full
  copies; each call takes the B oldest rows of the oldest request's task, and a task whose copy
  is not resident first evicts the least recently used one and loads its weights (load_state_dict
  from memory: cheaper than the disk read a real worker pays, so it favours full copies).

TTFT = when the call holding the request's row finishes (prefill only: the shared decoder is the same
either way, so decoding is not run). tok/s = prompt tokens / wall. Weights: the SmolLM2-135M GGUF in
models/ dequantised to fp32 (real weights); adapters random (values do not change the time). The
machine's 2 cores are shared by ~8 engineers: compare the two modes of one run, not across runs.
Writes benchmarks/results/sun_adapters/<variant>.{json,md,png}. `--backend llamacpp`: the same trace on
the GGUF base with GGUF LoRA adapters (benchmarks/lib/sun_adapters_llamacpp.py says how), variant llamacpp.
"""
from __future__ import annotations

import argparse
import json
import time
from collections import OrderedDict
from pathlib import Path

import numpy as np
import torch

from benchmarks.lib.results import ROOT, result_stem

MODEL = ROOT / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
RANK = 16


def zipf_trace(n_tasks: int, n_requests: int, seed: int = 0, s: float = 1.1) -> list:
    rng = np.random.default_rng(seed)
    p = 1.0 / np.arange(1, n_tasks + 1) ** s
    return [int(t) for t in rng.choice(n_tasks, size=n_requests, p=p / p.sum())]


def _prompts(n: int, length: int, vocab: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, vocab, (n, length), generator=g)


def run_adapters(view, trace, prompts, batch: int) -> dict:
    from edge.model.lora.apply import lora_prefill
    ttft, t0 = [0.0] * len(trace), time.perf_counter()
    lengths = torch.full((batch,), prompts.shape[1])
    for i in range(0, len(trace), batch):
        rows = list(range(i, min(i + batch, len(trace))))
        with torch.inference_mode():
            lora_prefill(view, prompts[rows], lengths[:len(rows)], [f"t{trace[r]}" for r in rows])
        for r in rows:
            ttft[r] = time.perf_counter() - t0
    return {"wall_s": time.perf_counter() - t0, "ttft_s": ttft, "calls": -(-len(trace) // batch), "loads": 0}


def run_full_copies(slots: list, base_state: dict, trace, prompts, batch: int) -> dict:
    from edge.model.sun_modules import prefill_batch
    resident: "OrderedDict[int, int]" = OrderedDict()     # task -> slot, least recently used first
    waiting = list(range(len(trace)))
    ttft, t0, calls, loads = [0.0] * len(trace), time.perf_counter(), 0, 0
    while waiting:
        task = trace[waiting[0]]
        if task not in resident:
            slot = len(resident) if len(resident) < len(slots) else resident.popitem(last=False)[1]
            slots[slot].load_state_dict(base_state)       # this task's copy (the same shape and bytes)
            resident[task], loads = slot, loads + 1
        resident.move_to_end(task)
        rows = [r for r in waiting if trace[r] == task][:batch]
        with torch.inference_mode():
            prefill_batch(slots[resident[task]], prompts[rows], torch.full((len(rows),), prompts.shape[1]))
        calls += 1
        for r in rows:
            ttft[r] = time.perf_counter() - t0
        waiting = [r for r in waiting if r not in set(rows)]
    return {"wall_s": time.perf_counter() - t0, "ttft_s": ttft, "calls": calls, "loads": loads}


def _summary(res: dict, tokens: int) -> dict:
    t = np.array(res.pop("ttft_s")) * 1e3
    return {**res, "tok_s": tokens / res["wall_s"], "ttft_p50_ms": float(np.percentile(t, 50)),
            "ttft_p99_ms": float(np.percentile(t, 99))}


def bench(base, n_tasks: int, n_requests: int, prompt_len: int, batch: int, seed: int) -> dict:
    from edge.model.lora.adapter import init_adapter
    from edge.model.lora.apply import LoraTransformer
    from edge.model.transformer import Transformer
    cfg = base.cfg
    view = LoraTransformer.over(base)
    one = 0
    for t in range(n_tasks):
        ad = init_adapter(cfg, RANK, seed=t)
        for b in ad.lora_b.values():
            b.normal_(std=0.01)
        view.add_adapter(f"t{t}", ad)
        one = ad.nbytes
    model_bytes = sum(p.numel() * p.element_size() for p in base.state_dict().values())
    budget = model_bytes + n_tasks * one
    k = max(1, budget // model_bytes)
    base_state = base.state_dict()
    slots = [base] + [Transformer(cfg).eval() for _ in range(k - 1)]
    trace = zipf_trace(n_tasks, n_requests, seed)
    prompts = _prompts(n_requests, prompt_len, cfg.vocab_size, seed)
    tokens = n_requests * prompt_len
    ada = _summary(run_adapters(view, trace, prompts, batch), tokens)
    full = _summary(run_full_copies(slots, base_state, trace, prompts, batch), tokens)
    return {"tasks": n_tasks, "requests": n_requests, "prompt_len": prompt_len, "batch": batch, "rank": RANK,
            "adapter_bytes": one, "model_bytes": model_bytes, "budget_bytes": budget, "full_copies_fit": int(k),
            "distinct_tasks_in_trace": len(set(trace)), "adapters": ada, "full_copies": full,
            "tok_s_ratio": ada["tok_s"] / full["tok_s"], "ttft_p99_ratio": full["ttft_p99_ms"] / ada["ttft_p99_ms"]}


def markdown(runs: list, meta: dict) -> str:
    lines = ["# SUN prefill: adapters in one worker vs full copies under the same memory", "",
             f"torch, {meta['threads']} threads, SmolLM2-135M ({meta['weights']}), rank-{RANK} adapters (F32, all "
             "seven linears), a burst of requests with Zipf(1.1) task popularity. Full copies: as many as the "
             "adapter worker's memory holds; a missing task's copy evicts the least recently used (weights loaded "
             "from memory, cheaper than from disk). Prefill only. The 2 cores were shared with ~8 other "
             "engineers' work: compare the modes of a row, not rows across runs.", "",
             "| tasks | requests x tokens | budget | full copies fit | mode | calls | copy loads | tok/s | "
             "TTFT p50 | TTFT p99 | adapters / full copies (tok/s) |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in runs:
        for mode in ("adapters", "full_copies"):
            m = r[mode]
            ratio = f"{r['tok_s_ratio']:.2f}x" if mode == "adapters" else ""
            lines.append(f"| {r['tasks']} | {r['requests']} x {r['prompt_len']} | {r['budget_bytes'] / 1e6:.0f} MB | "
                         f"{r['full_copies_fit']} | {mode.replace('_', ' ')} | {m['calls']} | {m['loads']} | "
                         f"{m['tok_s']:.0f} | {m['ttft_p50_ms']:.0f} ms | {m['ttft_p99_ms']:.0f} ms | {ratio} |")
    return "\n".join(lines) + "\n"


def plot(runs: list, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    x = np.arange(len(runs))
    for i, mode in enumerate(("adapters", "full_copies")):
        axes[0].bar(x + (i - 0.5) * 0.4, [r[mode]["tok_s"] for r in runs], 0.4, label=mode.replace("_", " "))
        axes[1].bar(x + (i - 0.5) * 0.4, [r[mode]["ttft_p99_ms"] for r in runs], 0.4, label=mode.replace("_", " "))
    for ax, title in zip(axes, ("prefill tok/s", "TTFT p99 (ms)")):
        ax.set_xticks(x, [f"{r['tasks']} tasks" for r in runs])
        ax.set_title(title)
        ax.legend(fontsize=8)
    fig.suptitle("SUN prefill, same memory: one worker with adapters vs full copies (SmolLM2-135M, torch)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tasks", default="8,64", help="task counts, comma-separated")
    ap.add_argument("--requests", type=int, default=96)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--batch", type=int, default=16, help="rows per prefill call")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="stem (default benchmarks/results/sun_adapters/default)")
    ap.add_argument("--backend", choices=("torch", "llamacpp"), default="torch",
                    help="llamacpp: the GGUF base + GGUF LoRA worker (benchmarks/lib/sun_adapters_llamacpp.py)")
    ap.add_argument("--reps", type=int, default=3, help="llamacpp: repetitions of each mode (medians)")
    ap.add_argument("--adapter-type", default="F16", choices=("F16", "F32"), help="llamacpp: adapter files")
    a = ap.parse_args(argv)
    if a.backend == "llamacpp":
        return main_llamacpp(a)
    from edge.model.checkpoint import load_model
    torch.set_num_threads(a.threads)
    base = load_model(MODEL)[0].eval()
    meta = {"threads": a.threads, "weights": f"real: {MODEL.name} dequantised to fp32", "model": MODEL.name}
    runs = []
    for n in (int(x) for x in a.tasks.split(",")):
        runs.append(bench(base, n, a.requests, a.prompt_len, a.batch, a.seed))
        r = runs[-1]
        print(f"{n} tasks: adapters {r['adapters']['tok_s']:.0f} tok/s, full copies {r['full_copies']['tok_s']:.0f} "
              f"tok/s ({r['full_copies_fit']} fit, {r['full_copies']['loads']} loads)", flush=True)
    stem = Path(a.out) if a.out else result_stem("sun_adapters")
    stem.parent.mkdir(parents=True, exist_ok=True)
    stem.with_suffix(".json").write_text(json.dumps({"meta": meta, "runs": runs}, indent=1))
    stem.with_suffix(".md").write_text(markdown(runs, meta))
    plot(runs, stem.with_suffix(".png"))
    print(stem.with_suffix(".md").read_text())


def main_llamacpp(a) -> None:
    import os
    import platform

    from benchmarks.lib.sun_adapters_llamacpp import run_all
    from benchmarks.lib.sun_adapters_report import llamacpp_markdown, llamacpp_plot
    from edge.model.checkpoint import load_checkpoint
    cfg = load_checkpoint(MODEL).config
    res = run_all(MODEL, cfg, [int(x) for x in a.tasks.split(",")], a.requests, a.prompt_len, a.batch, a.threads,
                  a.reps, a.seed, a.adapter_type, zipf_trace)
    cpus = sorted(os.sched_getaffinity(0))
    meta = {"backend": "llama.cpp", "threads": a.threads, "model": MODEL.name, "base": f"{MODEL.name} as shipped",
            "adapter_type": a.adapter_type, "reps": a.reps, "cpus_allowed": cpus, "nice": os.nice(0),
            "machine": f"{platform.machine()}, {os.cpu_count()} cores shared with other engineers' work"}
    stem = Path(a.out) if a.out else result_stem("sun_adapters", "llamacpp")
    stem.parent.mkdir(parents=True, exist_ok=True)
    stem.with_suffix(".json").write_text(json.dumps({"meta": meta, **res}, indent=1))
    stem.with_suffix(".md").write_text(llamacpp_markdown(res, meta))
    llamacpp_plot(res["runs"], stem.with_suffix(".png"))
    print(stem.with_suffix(".md").read_text())


if __name__ == "__main__":
    main()
