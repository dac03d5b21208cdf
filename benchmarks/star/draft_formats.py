"""Which file should a CPU hub's draft service load? The same 0.5B weights in each GGUF storage format.

A draft service's cost is D(b): one batched draft step over b sessions. On an x86 core llama.cpp
repacks Q4_0 (and Q4_K) weights into its multi-row AVX layout, multiplies 4 rows at a time there
and runs the rest row by row, so D(b) is not linear in b and differs a lot between formats. The
format also moves the draft's agreement with the target (requantising from Q4_K_M loses detail).
Measured side by side in one run, per format:

* D(b) of the engine alone (one `step` over b sequences, ~120 tokens of context each), b = 1..8,
  on `--threads` threads (1: the draft service's core in the two-device star);
* D(b) of the real DraftService (b requests of γ drafts each, one token fed: a rejection);
* greedy agreement with the target's own greedy text, position by position (MT-bench first turns
  and code prompts), the α the star's acceptance follows.

  python -m benchmarks.star.draft_formats [--formats native,Q4_0,Q8_0,BF16,F16] [--prompts 8] [--reps 9]
Run from the repository root. Writes benchmarks/results/draft_formats/<variant>.{json,md,png}
(--out; default: the variant `default`).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

from benchmarks.lib.results import result_stem

OUT = result_stem("draft_formats")
BATCHES = (1, 2, 3, 4, 6, 8)


def args_of(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--draft", default="qwen2.5-coder-0.5b")
    ap.add_argument("--target", default="qwen2.5-coder-1.5b")
    ap.add_argument("--formats", default="native,Q4_0,Q8_0,BF16,F16")
    ap.add_argument("--threads", type=int, default=1, help="the draft's threads (1: one core of the star)")
    ap.add_argument("--gamma", type=int, default=4, help="drafts per request in the service's D(b)")
    ap.add_argument("--prompts", type=int, default=8, help="per set (MT-bench, code) for the agreement")
    ap.add_argument("--tokens", type=int, default=64, help="target tokens per prompt for the agreement")
    ap.add_argument("--reps", type=int, default=9, help="timed repeats per batch size (medians)")
    ap.add_argument("--out", type=Path, default=OUT, help="results path without suffix")
    return ap.parse_args(argv)


def engine_steps(engine, reps: int) -> dict:
    """b -> median ms of one engine step over b sequences."""
    seqs = [engine.new_sequence() for _ in range(max(BATCHES))]
    for i, s in enumerate(seqs):
        engine.forward_last(s, [(100 + 7 * i + j) % 5000 for j in range(120)])
    out = {}
    for b in BATCHES:
        times = []
        for r in range(reps + 2):                      # two warm-ups
            t = time.perf_counter()
            engine.step(seqs[:b], [(r * 13 + k) % 5000 for k in range(b)])
            times.append(time.perf_counter() - t)
        out[b] = 1e3 * statistics.median(times[2:])
    for s in seqs:
        engine.free(s)
    return out


def target_texts(args, tok) -> dict:
    """set -> [(prompt ids, the target's greedy continuation)]."""
    from benchmarks.lib.datasets import code_prompts, mtbench_first_turns
    from edge.engines.llamacpp_engine import LlamaCppEngine
    from edge.speculative.generate import generate_plain
    from edge.model.reference import resolve_model
    target = LlamaCppEngine(resolve_model(args.target), max_len=1024, n_seq_max=1, threads=os.cpu_count())
    sets = {"mtbench": mtbench_first_turns(args.prompts), "code": code_prompts(args.prompts)}
    out = {}
    for kind, texts in sets.items():
        out[kind] = []
        for text in texts:
            ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": text}]))
            out[kind].append((ids, generate_plain(target, ids, args.tokens, stop_ids=tuple(tok.eos_ids)).tokens))
    target.close()
    return out


def agreement(engine, texts: dict) -> dict:
    """set -> the fraction of the target's greedy tokens the draft's argmax matches."""
    from benchmarks.lib.scaling_sweep import forced_hits
    return {kind: sum(forced_hits(engine, ids, cont) for ids, cont in items if cont)
            / max(1, sum(len(cont) for _, cont in items)) for kind, items in texts.items()}


def main(argv=None) -> None:
    args = args_of(argv)
    from benchmarks.lib.scaling_sweep import measure_service
    from edge.engines.llamacpp_engine import LlamaCppEngine
    from edge.engines.loader import open_model
    from export.target_format import target_gguf
    _, tok = open_model(str(target_gguf(args.draft)), backend="llamacpp", threads=1, max_len=256)
    texts = target_texts(args, tok)
    prompts = [ids for items in texts.values() for ids, _ in items]
    rows = []
    for fmt in args.formats.split(","):
        path = target_gguf(args.draft, fmt)
        engine = LlamaCppEngine(path, max_len=1024, n_seq_max=max(BATCHES) + 1, threads=args.threads)
        row = {"format": fmt, "file": path.name, "mib": round(path.stat().st_size / 2**20),
               "engine_ms": engine_steps(engine, args.reps)}
        row["service_ms"] = {b: 1e3 * t for b, t in
                             measure_service(engine, list(BATCHES), args.gamma, prompts, args.reps).items()}
        row["agreement"] = agreement(engine, texts)
        engine.close()
        rows.append(row)
        print(json.dumps(row), flush=True)
    write(rows, args)


def write(rows: list, args) -> None:
    from edge.telemetry.cpu_info import cpu_name
    meta = {"cpu": cpu_name(), "threads": args.threads, "gamma": args.gamma,
            "draft": args.draft, "target": args.target, "prompts": args.prompts, "tokens": args.tokens,
            "reps": args.reps, "load": os.getloadavg(), "when": time.strftime("%Y-%m-%d %H:%M")}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    base = rows[0]
    lines = [f"# The draft's storage format: {args.draft} on {args.threads} thread(s), {meta['cpu']}",
             "",
             f"Same weights (requantised from the fetched file by llama.cpp's quantiser), measured in one run "
             f"({meta['when']}, load {meta['load'][0]:.1f} at the end). D(b): median of {args.reps} "
             f"batched steps over b sequences; the service's D(b): b requests of γ={args.gamma} drafts. "
             f"Agreement: the draft's argmax vs {args.target}'s own greedy text, {args.prompts} prompts a set, "
             f"{args.tokens} tokens each.",
             "",
             "| format | MiB | " + " | ".join(f"step b={b} ms" for b in BATCHES) + " | step ms per seq, b=8 | "
             f"service b=1 ms | service b=8 ms | vs {base['format']} b=1 | vs {base['format']} b=8 | "
             "agree MT-bench | agree code |",
             "|---" * (len(BATCHES) + 10) + "|"]
    for r in rows:
        e, s = r["engine_ms"], r["service_ms"]
        lines.append(f"| {r['format']} | {r['mib']} | " + " | ".join(f"{e[b]:.1f}" for b in BATCHES)
                     + f" | {e[8] / 8:.1f} | {s[1]:.0f} | {s[8]:.0f} | {base['service_ms'][1] / s[1]:.2f}x | "
                       f"{base['service_ms'][8] / s[8]:.2f}x | {r['agreement']['mtbench']:.3f} | "
                       f"{r['agreement']['code']:.3f} |")
    lines += ["", "vs: the service's speed relative to the first format (higher is faster)."]
    args.out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    plot(rows, args.out.with_suffix(".png"))
    print("\n".join(lines))


def plot(rows: list, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for r in rows:
        ax.plot(BATCHES, [r["engine_ms"][b] for b in BATCHES], marker="o", label=f"{r['format']} ({r['mib']} MiB)")
    ax.set_xlabel("sequences in one batched step (b)")
    ax.set_ylabel("ms per step")
    ax.set_title("draft step cost vs batch, per storage format")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
