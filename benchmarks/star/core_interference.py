"""What "cores as devices" costs the target: its tok/s on core 0 while core 1 idles or drafts.

benchmarks/star/starsd_two_device.py measures the star with the target on core 0 and the hub + draft
service on core 1. The two cores still share memory bandwidth and cache, so whenever the draft
service computes (a prompt's prefill, drafts, draft-ahead, background probes) the target's own
steps slow down, which a real second device would not do. This measures that slowdown directly,
side by side in one run: the target decodes alone on core 0 while a process on core 1

* idles (sleeps),
* decodes the draft model one token at a time without pause (a busy draft service),

alternating, `--rounds` times each; per target storage format (the wide BF16/F16 file the star
benchmarks use: memory-bound; the fetched Q4_K_M: compute-bound).

  python -m benchmarks.star.core_interference [--formats BF16,native] [--rounds 3] [--new 48]
Run from the repository root. Writes benchmarks/results/core_interference/<variant>.{json,md,png}
(--out; default: the variant `default`).
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import time
from pathlib import Path

from benchmarks.lib.results import result_stem

OUT = result_stem("core_interference")
LOADS = ("idle", "draft decoding")


def neighbour(stop, ready, core: int, load: str, draft: str, fmt: str) -> None:
    """The process on the other core: idles, or decodes the draft until told to stop."""
    os.sched_setaffinity(0, {core})
    if load == "idle":
        ready.set()
        stop.wait()
        return
    from edge.engines.llamacpp_engine import LlamaCppEngine
    from export.target_format import target_gguf
    e = LlamaCppEngine(str(target_gguf(draft, fmt)), max_len=2048, n_seq_max=1, threads=1)
    s = e.new_sequence()
    e.forward_last(s, list(range(100, 160)))
    ready.set()
    n = 0
    while not stop.is_set():
        e.step([s], [100 + n % 1000])
        n += 1
        if e.length(s) > 1500:
            e.truncate(s, 60)


def measure(engine, ids, new: int, load: str, args) -> float:
    from edge.speculative.generate import generate_plain
    stop, ready = mp.Event(), mp.Event()
    p = mp.Process(target=neighbour, args=(stop, ready, args.cores[1], load, args.draft, args.draft_format))
    p.start()
    try:
        if not ready.wait(120):
            raise RuntimeError("the neighbour process did not start in 120 s")
        time.sleep(0.5)
        return generate_plain(engine, ids, new).tokens_per_s
    finally:
        stop.set()
        p.join()


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", default="qwen2.5-coder-1.5b")
    ap.add_argument("--draft", default="qwen2.5-coder-0.5b")
    ap.add_argument("--draft-format", default="Q4_0", help="the busy neighbour's draft file (the star's draft)")
    ap.add_argument("--formats", default="BF16,native", help="the target's storage formats, comma-separated")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--new", type=int, default=48, help="tokens per timed generation")
    ap.add_argument("--out", type=Path, default=OUT, help="results path without suffix")
    args = ap.parse_args(argv)
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        sys.exit("this needs two cores (the target on one, its neighbour on another)")
    args.cores = cores[:2]
    os.sched_setaffinity(0, {args.cores[0]})
    from edge.telemetry.cpu_info import cpu_name
    from edge.engines.llamacpp_engine import LlamaCppEngine
    from edge.speculative.generate import generate_plain
    from export.target_format import target_gguf
    rows = []
    for fmt in [f.strip() for f in args.formats.split(",") if f.strip()]:
        path = target_gguf(args.target, fmt)
        engine = LlamaCppEngine(str(path), max_len=2048, n_seq_max=1, threads=1)
        ids = list(range(1000, 1060))
        generate_plain(engine, ids, 8)                      # warm-up
        got = {load: [] for load in LOADS}
        for r in range(args.rounds):
            for load in LOADS:
                got[load].append(measure(engine, ids, args.new, load, args))
                print(f"{path.name} round {r + 1}: {load}: {got[load][-1]:.2f} tok/s", flush=True)
        engine.close()
        med = {load: statistics.median(v) for load, v in got.items()}
        rows.append({"target_file": path.name, "format": fmt, "tok_s": got, "median_tok_s": med,
                     "ratio": med["draft decoding"] / med["idle"]})
    write(rows, args, cpu_name())


def write(rows, args, cpu: str) -> None:
    meta = {"cpu": cpu, "cores": args.cores, "target": args.target, "draft": args.draft,
            "draft_format": args.draft_format, "rounds": args.rounds, "new_tokens": args.new}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    lines = [f"# The target on core {args.cores[0]} while core {args.cores[1]} idles or decodes the draft", "",
             f"CPU: {cpu}. Target {args.target}, one thread; neighbour: {args.draft} ({args.draft_format}) decoding "
             f"one token at a time, one thread. {args.new} tokens a generation, medians of {args.rounds}, "
             "the two loads alternating.", "",
             "| target file | idle tok/s | draft decoding tok/s | ratio |", "|---|---|---|---|"]
    for r in rows:
        m = r["median_tok_s"]
        lines.append(f"| {r['target_file']} | {m['idle']:.2f} | {m['draft decoding']:.2f} | {r['ratio']:.2f} |")
    lines += ["", "A ratio below 1 is what the two-device rows lose while the draft service computes and a real "
              "second device would not: memory bandwidth and cache are shared between the cores."]
    args.out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 3.2))
    xs = range(len(rows))
    for i, load in enumerate(LOADS):
        ax.bar([x + (i - 0.5) * 0.4 for x in xs], [r["median_tok_s"][load] for r in rows], 0.4,
               label=f"core {args.cores[1]}: {load}")
    ax.set_xticks(list(xs), [r["target_file"] for r in rows], fontsize=7)
    ax.set_ylabel("target tok/s (median)")
    ax.legend()
    ax.set_title("The target's tok/s vs what the other core does")
    fig.tight_layout()
    fig.savefig(args.out.with_suffix(".png"), dpi=120)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
