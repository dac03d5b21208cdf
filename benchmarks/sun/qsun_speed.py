"""QSUN speed: the shared decoder's step time with int4 (Q4_0) weights vs full precision, same runtime.

The decoder is exported twice with export/gguf.py - F16 (and F32) and Q4_0 on
export/quant.py's grid, the exact weights QSUN tunes against - and llama.cpp
decodes with each: one token per call after a prompt (decode is a sequence of
such steps). Medians over repeats, measured side by side in one run.

Then the same two files serve as the SUN shared decoder itself (SharedDecoder
over our LlamaCppEngine): KV blobs from a torch prefill are imported into
llama.cpp and decoded in batches of 1, 4 and 16 - the QSUN serving path.

  python -m benchmarks.sun.qsun_speed                 # SmolLM2-135M, ~2 min
Run from the repository root. Writes benchmarks/results/qsun_speed/<variant>.{json,md,png}
(--out; default: the variant `default`). Goal (issue): >= 1.45x.
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.lib.results import result_stem


def step_times(path: Path, threads: int, prompt_len: int, steps: int, repeats: int):
    from llama_cpp import Llama
    llm = Llama(model_path=str(path), n_ctx=prompt_len + steps + 8, n_threads=threads, n_batch=prompt_len,
                logits_all=False, verbose=False)
    prompt = [1 + (i * 7) % 1000 for i in range(prompt_len)]
    per_run = []
    for _ in range(repeats):
        llm.reset()
        llm.eval(prompt)
        ts = []
        tok = 1
        for _ in range(steps):
            t0 = time.perf_counter()
            llm.eval([tok])
            ts.append(time.perf_counter() - t0)
            tok = (tok * 31 + 7) % 1000 + 1
        per_run.append(statistics.median(ts))
    del llm
    return statistics.median(per_run)


def serving_rate(path: Path, blob: bytes, batch: int, new: int, threads: int, repeats: int) -> float:
    """Tokens/s of a SharedDecoder on llama.cpp decoding `batch` imported copies of `blob`."""
    from edge.engines.llamacpp_engine import LlamaCppEngine
    from edge.sun.decoder import SharedDecoder
    eng = LlamaCppEngine(path, max_len=512, n_seq_max=batch, threads=threads, fingerprint="qsun-bench")
    rates = []
    for r in range(repeats):
        dec = SharedDecoder(eng, max_batch=batch)
        for i in range(batch):
            dec.admit(blob, request_id=f"{r}-{i}", max_new=new)
        t0 = time.perf_counter()
        got = dec.run()
        rates.append(sum(len(x.tokens) - 1 for x in got.values()) / (time.perf_counter() - t0))
    eng.close()
    return statistics.median(rates)


def torch_blob(src: Path, prompt_len: int) -> bytes:
    """A KV blob (+ first token) of a prompt, prefilled by torch: what a prefill worker sends."""
    from edge.model.checkpoint import load_model
    from edge.engines.torch_engine import TorchEngine
    from edge.sun.prefill import PrefillWorker
    model, _ = load_model(src)
    worker = PrefillWorker(TorchEngine(model.float().eval(), fingerprint="qsun-bench"), "bench")
    return worker.prefill([1 + (i * 7) % 1000 for i in range(prompt_len)]).blob


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--batches", default="1,4,16", help="SharedDecoder batch sizes for the serving part")
    ap.add_argument("--out", default=str(result_stem("qsun_speed")), help="results path without suffix")
    args = ap.parse_args(argv)
    from edge.model.fetch import model_path
    from export.gguf import export_gguf
    src = model_path(args.model)
    if not src.exists():
        sys.exit(f"{src} is missing: run `make models` first")
    res = {"machine": platform.platform(), "args": vars(args), "step_s": {}}
    with tempfile.TemporaryDirectory() as d:
        files = {ft: export_gguf(src, Path(d) / f"dec-{ft}.gguf", ftype=ft) for ft in ("F32", "F16", "Q4_0")}
        for rep in range(2):  # interleave formats so a load spike hits both
            for ft, f in files.items():
                t = step_times(f, args.threads, args.prompt_len, args.steps, args.repeats)
                res["step_s"].setdefault(ft, []).append(t)
        blob = torch_blob(src, args.prompt_len)
        batches = [int(b) for b in args.batches.split(",")]
        res["serving_tok_s"] = {}
        for rep in range(2):
            for b in batches:
                for ft in ("F16", "Q4_0"):
                    rate = serving_rate(files[ft], blob, b, args.steps, args.threads, 3)
                    res["serving_tok_s"].setdefault(f"{ft}@{b}", []).append(rate)
    step = {ft: statistics.median(v) for ft, v in res["step_s"].items()}
    res["median_step_s"] = step
    res["speedup_q4_vs_f16"] = step["F16"] / step["Q4_0"]
    res["speedup_q4_vs_f32"] = step["F32"] / step["Q4_0"]
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(res, indent=1))
    md = (f"# QSUN decoder step time, llama.cpp, {args.model}, {args.threads} threads\n\n"
          "| weights | step (ms) | tok/s | Q4_0 speedup |\n|---|---:|---:|---:|\n" +
          "".join(f"| {ft} | {1e3 * s:.1f} | {1 / s:.1f} | {s / step['Q4_0']:.2f}x |\n" for ft, s in step.items()) +
          f"\nMachine: {res['machine']}; context {args.prompt_len} tokens, medians of {args.repeats} x "
          f"{args.steps} steps, two interleaved rounds.\n")
    serve = {k: statistics.median(v) for k, v in res["serving_tok_s"].items()}
    res["median_serving_tok_s"] = serve
    md += ("\n## As the SUN shared decoder (SharedDecoder on LlamaCppEngine, KV blobs imported from a torch "
           f"prefill of {args.prompt_len} tokens, {args.steps} tokens each)\n\n"
           "| batch | F16 tok/s | Q4_0 tok/s | Q4_0 speedup |\n|---:|---:|---:|---:|\n" +
           "".join(f"| {b} | {serve[f'F16@{b}']:.1f} | {serve[f'Q4_0@{b}']:.1f} | "
                   f"{serve[f'Q4_0@{b}'] / serve[f'F16@{b}']:.2f}x |\n" for b in batches) +
           "\nMedians of 3 runs per cell, two interleaved rounds.\n")
    out.with_suffix(".json").write_text(json.dumps(res, indent=1))
    out.with_suffix(".md").write_text(md)
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(8, 3))
    ax.bar(list(step), [1 / s for s in step.values()])
    ax.set_ylabel("decode tok/s (batch 1)")
    for i, ft in enumerate(("F16", "Q4_0")):
        ax2.bar([j + 0.4 * i for j in range(len(batches))], [serve[f"{ft}@{b}"] for b in batches], 0.4, label=ft)
    ax2.set_xticks([j + 0.2 for j in range(len(batches))], [f"batch {b}" for b in batches])
    ax2.set_ylabel("shared decoder tok/s")
    ax2.legend()
    fig.tight_layout()
    fig.savefig(out.with_suffix(".png"), dpi=100)
    print(md)


if __name__ == "__main__":
    main()
