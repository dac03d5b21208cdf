"""Which fix for llama.cpp's AMX crash (issue 9): tok/s of the 1.5B target with each candidate.

On AMX CPUs a `-march=native` llama.cpp repacks quantised weights into an AMX buffer and
segfaults (llama.cpp issue 20824). Two fixes make it run:
  build:   AMX off at build time (-mno-amx-*); llama.cpp keeps its extra buffer types,
           i.e. the CPU repack of Q4_0 / Q4_K / IQ4_NL weights into interleaved layouts;
  runtime: use_extra_bufts=False; no AMX buffer, but no CPU repack either.
The installed wheel is the build candidate (`make llama`); the runtime candidate is the same
wheel with extra buffer types off. Each: greedy decode of a fixed prompt, alternating, medians.

  python -m benchmarks.engines.llamacpp_amx_fix [--model qwen2.5-coder-1.5b] [--rounds 5] [--threads 2]
Run from the repository root. Writes benchmarks/results/llamacpp_amx_fix/<variant>.{json,md,png}
(--out; default: the variant `default`).
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

from benchmarks.lib.results import result_stem
from edge.telemetry.cpu_info import cpu_name

PROMPT = "def quicksort(xs):\n    \"\"\"Sort a list of integers.\"\"\"\n"


def decode_rate(path, extra_bufts, threads, new):
    from edge.engines.llamacpp_engine import LlamaCppEngine
    from edge.speculative.generate import generate_plain
    from edge.model.tokenizer import Tokenizer
    ids = Tokenizer.from_gguf(path).encode(PROMPT)
    eng = LlamaCppEngine(path, max_len=512, n_seq_max=1, threads=threads, extra_bufts=extra_bufts)
    generate_plain(eng, ids, 4)                                 # warm-up
    t0 = time.perf_counter()
    out = generate_plain(eng, ids, new)
    rate = len(out.tokens) / (time.perf_counter() - t0)
    del eng
    return rate, out.tokens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="qwen2.5-coder-1.5b")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--out", type=Path, default=result_stem("llamacpp_amx_fix"), help="results path without suffix")
    args = ap.parse_args()
    import llama_cpp
    from edge.engines.llamacpp_engine import amx_compiled
    from edge.model.fetch import model_path
    path = model_path(args.model)
    cands = {"build (AMX off, extra buffers on)": None, "runtime (use_extra_bufts=False)": False}
    rates = {k: [] for k in cands}
    texts = {}
    for r in range(args.rounds):
        for name, eb in (cands.items() if r % 2 == 0 else reversed(list(cands.items()))):
            rate, toks = decode_rate(path, eb, args.threads, args.new)
            rates[name].append(rate)
            texts.setdefault(name, toks)
            print(f"round {r}: {name}: {rate:.2f} tok/s", flush=True)
    med = {k: statistics.median(v) for k, v in rates.items()}
    base = med["runtime (use_extra_bufts=False)"]
    info = llama_cpp.llama_print_system_info().decode()
    res = {"model": args.model, "threads": args.threads, "new_tokens": args.new, "rounds": args.rounds,
           "machine": platform.processor() or platform.machine(), "cpu": cpu_name(),
           "amx_backend_compiled": amx_compiled(llama_cpp), "system_info": info,
           "tok_s": rates, "median_tok_s": med, "same_text": len({tuple(t) for t in texts.values()}) == 1}
    out = args.out
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(res, indent=1))
    lines = [f"# llama.cpp AMX fix candidates: {args.model}, {args.threads} threads, {args.new} greedy tokens, "
             f"medians of {args.rounds}", "", f"CPU: {res['cpu']}; AMX backend compiled: "
             f"{res['amx_backend_compiled']}; same text: {res['same_text']}", "",
             "| candidate | tok/s (median) | vs runtime fix |", "|---|---:|---:|"]
    lines += [f"| {k} | {v:.2f} | {v / base:.2f}x |" for k, v in med.items()]
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 3))
    ax.barh(list(med), list(med.values()))
    ax.set_xlabel("tok/s (median)")
    ax.set_title(f"{args.model}: the two AMX-crash fixes")
    fig.tight_layout()
    fig.savefig(out.with_suffix(".png"), dpi=120)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
