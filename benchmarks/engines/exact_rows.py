"""What `--exact-rows` costs (edge/engines/llamacpp_rows.py), and that it holds, on a real GGUF.

Four engines of one GGUF side by side -- weights repacked or not, exact rows or not -- each over
the same prompt of random tokens (--depth cached), then the calls a target makes, variants taking
turns call by call in every repeat (the machine is shared), medians of the repeats:

* `decode 1`: a lone decode step (one row); `verify 5`: one sequence's γ = 4 verify;
* `step 4x1`: four requests' decode step at once; `verify 4x5`: four requests' verifies at once.

Each cell is the process CPU of the call (both threads) and its wall time. Beside them, whether
the variant's rows are exact: a 5-row verify's logits equal five one-row decodes' bit for bit.

  python -m benchmarks.engines.exact_rows                                   # 1.5B, ~3 min
  python -m benchmarks.engines.exact_rows --model qwen2.5-coder-0.5b --out benchmarks/results/exact_rows/qwen0.5b

Run from the repository root. Writes benchmarks/results/exact_rows/<variant>.{json,png,md}.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time

import numpy as np

from benchmarks.lib.results import result_stem

VARIANTS = {"unrepacked": (False, False), "unrepacked, exact rows": (False, True),
            "repacked": (True, False), "repacked, exact rows": (True, True)}
CALLS = ("decode 1", "verify 5", "step 4x1", "verify 4x5")


def _engines(path: str, threads: int, depth: int):
    from edge.engines.llamacpp_engine import LlamaCppEngine
    prompt = [int(t) for t in np.random.default_rng(0).integers(100, 20000, depth)]
    out = {}
    for name, (repack, exact) in VARIANTS.items():
        eng = LlamaCppEngine(path, max_len=depth + 64, n_seq_max=4, threads=threads, extra_bufts=repack,
                             exact_rows=exact)
        seqs = [eng.new_sequence() for _ in range(4)]
        for s in seqs:
            eng.forward_last(s, prompt)
        out[name] = (eng, seqs)
    return out


def _call(eng, seqs, call: str, toks) -> None:
    """One call of the kind, then every sequence cut back to the prompt."""
    depth = eng.length(seqs[0])
    if call == "decode 1":
        eng.forward(seqs[0], toks[:1])
    elif call == "verify 5":
        eng.forward(seqs[0], toks[:5])
    elif call == "step 4x1":
        eng.step(seqs, toks[:4])
    else:
        eng.forward_batch([(s, toks[5 * i:5 * i + 5], 0) for i, s in enumerate(seqs)])
    for s in seqs:
        eng.truncate(s, depth)


def _exact(eng, seqs, toks) -> bool:
    depth = eng.length(seqs[0])
    rows = eng.forward(seqs[0], toks[:5])
    one = np.concatenate([eng.forward(seqs[1], [t]) for t in toks[:5]])
    for s in seqs[:2]:
        eng.truncate(s, depth)
    return bool(np.array_equal(rows, one))


def measure(path: str, threads: int, depth: int, repeats: int) -> dict:
    engines = _engines(path, threads, depth)
    rng = np.random.default_rng(1)
    cpu = {n: {c: [] for c in CALLS} for n in VARIANTS}
    wall = {n: {c: [] for c in CALLS} for n in VARIANTS}
    for rep in range(repeats + 1):                 # the first round warms up, not counted
        for call in CALLS:
            toks = [int(t) for t in rng.integers(100, 20000, 20)]
            for name, (eng, seqs) in engines.items():
                c0, w0 = time.process_time(), time.perf_counter()
                _call(eng, seqs, call, toks)
                if rep:
                    cpu[name][call].append(1e3 * (time.process_time() - c0))
                    wall[name][call].append(1e3 * (time.perf_counter() - w0))
    toks = [int(t) for t in rng.integers(100, 20000, 5)]
    exact = {name: _exact(eng, seqs, toks) for name, (eng, seqs) in engines.items()}
    for eng, _ in engines.values():
        eng.close()
    med = lambda d: {n: {c: round(statistics.median(v), 1) for c, v in cells.items()} for n, cells in d.items()}
    return {"cpu_ms": med(cpu), "wall_ms": med(wall), "rows_exact": exact}


def report(res: dict) -> str:
    m = res["meta"]
    lines = [f"# exact rows on {m['model']} ({m['threads']} threads, {m['depth']} tokens cached)", "",
             "Process CPU ms of one call (both threads), median of the repeats; wall ms in brackets. "
             "'exact': a 5-row verify equals five one-row decodes bit for bit.", "",
             "| variant | " + " | ".join(CALLS) + " | exact |", "|---|" + "---:|" * (len(CALLS) + 1)]
    for n in VARIANTS:
        cells = [f"{res['cpu_ms'][n][c]} ({res['wall_ms'][n][c]})" for c in CALLS]
        lines.append(f"| {n} | " + " | ".join(cells) + f" | {'yes' if res['rows_exact'][n] else 'no'} |")
    lines += ["", "Exact rows' CPU over the same layout without them:", "",
              "| layout | " + " | ".join(CALLS) + " |", "|---|" + "---:|" * len(CALLS)]
    for layout in ("unrepacked", "repacked"):
        r = [res["cpu_ms"][f"{layout}, exact rows"][c] / res["cpu_ms"][layout][c] for c in CALLS]
        lines.append(f"| {layout} | " + " | ".join(f"{x:.2f}x" for x in r) + " |")
    lines += ["", f"Machine: {m['cpu']}, {m['cpus']} CPUs; load average {m['load_before']} -> {m['load_after']}; "
              f"{m['repeats']} repeats; commit {m['commit']}.", "", f"Command: `{m['command']}`", ""]
    return "\n".join(lines)


def plot(res: dict, png) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(8, 4))
    width = 0.2
    for i, n in enumerate(VARIANTS):
        ax.bar([x + i * width for x in range(len(CALLS))], [res["cpu_ms"][n][c] for c in CALLS], width, label=n)
    ax.set_xticks([x + 1.5 * width for x in range(len(CALLS))], CALLS)
    ax.set_ylabel("process CPU ms per call")
    ax.set_title(f"exact rows: {res['meta']['model']}, {res['meta']['threads']} threads")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png, dpi=110)


def main(argv=None) -> None:
    import subprocess
    import sys
    from edge.telemetry.cpu_info import cpu_name
    from edge.model.fetch import model_path
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen2.5-coder-1.5b", help="a fetched model's name or a GGUF path")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--depth", type=int, default=600, help="prompt tokens cached before the calls")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--out", default=str(result_stem("exact_rows")))
    a = ap.parse_args(argv)
    path = a.model if os.path.isfile(a.model) else str(model_path(a.model))
    load0 = os.getloadavg()[0]
    res = measure(path, a.threads, a.depth, a.repeats)
    commit = subprocess.run(["git", "describe", "--always", "--dirty"], capture_output=True, text=True).stdout.strip()
    res["meta"] = {"model": os.path.basename(path), "threads": a.threads, "depth": a.depth, "repeats": a.repeats,
                   "cpu": cpu_name(), "cpus": os.cpu_count(), "host": platform.node(), "commit": commit,
                   "load_before": round(load0, 2), "load_after": round(os.getloadavg()[0], 2),
                   "command": "python -m benchmarks.engines.exact_rows " + " ".join(sys.argv[1:] if argv is None
                                                                                   else argv)}
    os.makedirs(os.path.dirname(a.out), exist_ok=True)
    with open(a.out + ".json", "w") as f:
        json.dump(res, f, indent=1)
    with open(a.out + ".md", "w") as f:
        f.write(report(res))
    plot(res, a.out + ".png")
    print(report(res))


if __name__ == "__main__":
    main()
