"""What one torch-engine call costs, before vs after the fast path, measured side by side.

For each model (fp32) and each engine variant -- `before` is the functional
reference path (`TorchEngine(fast=False)`: `Transformer.forward` over a padded
copy of the past, torch.cat of K/V per layer), `after` the fast path (in-place
KV cache, per-sequence attention over views, GQA without K/V copies,
MKL's skinny-matrix kernel for 1..5 rows where it is faster, see
edge.model.transformer.fast_linear); `@n` = the engine's threads. before@2 is the old
engine at torch's default on this 2-core box, before@1 the same code at one
thread (to tell the thread policy from the code changes), after@1 the new
engine at its default here, after@2 the new engine told threads=2 (calls over
<= 5 rows still run at one thread, larger ones at two) -- it measures:

* the batch-1 decode step (ms) next to the bandwidth bound: measured memory
  bandwidth (a large numpy copy, counted as read + write) / weight bytes read
  per step (all weights; a tied embedding once, as lm_head);
* one call over k tokens (verification), k = 1..9;
* one batched `step` over B sequences of ragged lengths, B = 1, 2, 4, 8, 16;
* a 64-token prefill: `forward` (all logits) and `forward_last` (one row).

Variants take turns call by call within every repeat (the machine is shared, the load
moves), and each number is the median over repeats. The bandwidth is measured
in every repeat too. Before timing, the after path's logits are checked against
the before path's on the real weights (max |diff|, argmax agreement).

  python -m benchmarks.engines.torch_engine_costs                      # both models, ~30 min on 2 busy cores
  python -m benchmarks.engines.torch_engine_costs --models smollm2-135m --repeats 3

Run from the repository root. Writes benchmarks/results/torch_engine_costs/<variant>.{json,png,md}
(--out; default: the variant `default`).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import time
from pathlib import Path

import numpy as np

from benchmarks.lib.results import result_stem

MODELS = ("smollm2-135m", "qwen2.5-coder-0.5b")
VARIANTS = {"before@2": (False, 2), "before@1": (False, 1), "after@1": (True, 1), "after@2": (True, 2)}
DEFAULT_VARIANTS = ",".join(VARIANTS)
KS = tuple(range(1, 10))
BATCHES = (1, 2, 4, 8, 16)
PROMPT = 64


def copy_bandwidth_gbs(mb: int = 256) -> float:
    """Bytes moved (read + write) per second by one large numpy copy."""
    a = np.ones(mb * 2**20 // 4, dtype=np.float32)
    b = np.empty_like(a)
    np.copyto(b, a)  # fault the pages in first
    t = time.perf_counter()
    np.copyto(b, a)
    return 2 * a.nbytes / (time.perf_counter() - t) / 1e9


def weight_bytes(model) -> int:
    """Bytes of weights one decode step reads (an untied embedding is only looked up)."""
    n = sum(p.numel() * p.element_size() for p in model.parameters())
    if not model.cfg.tie_embeddings:
        n -= model.model.embed_tokens.weight.numel() * model.model.embed_tokens.weight.element_size()
    return n


class Variant:
    """One engine (fast or reference path) with its sequences, timed at a thread count."""

    def __init__(self, model, fast: bool, threads: int, rng):
        from edge.engines.torch_engine import TorchEngine
        self.engine = TorchEngine(model, fast=fast, threads=threads)
        v = model.cfg.vocab_size
        self.prompts = [rng.integers(100, v, PROMPT + d).tolist() for d in range(-16, 16, 2)][:max(BATCHES)]
        self.prefill = rng.integers(100, v, PROMPT).tolist()
        self.seqs = [self.engine.new_sequence() for _ in self.prompts]
        for s, p in zip(self.seqs, self.prompts):
            self.engine.forward_last(s, p)

    def items(self):
        """(kind, size) of every measured call, in a fixed order."""
        return ([("verify_ms", k) for k in KS] + [("step_ms", B) for B in BATCHES]
                + [("prefill_ms", PROMPT), ("prefill_last_ms", PROMPT)])

    def measure(self, kind: str, n: int):
        """Run one call of `kind`, restore the sequences; (wall ms, process cpu ms)."""
        e = self.engine
        if kind == "verify_ms":
            s0, n0 = self.seqs[0], e.length(self.seqs[0])
            fn, undo = (lambda: e.forward(s0, [7] * n)), (lambda: e.truncate(s0, n0))
        elif kind == "step_ms":
            seqs = self.seqs[:n]
            lens = [e.length(s) for s in seqs]
            fn = lambda: e.step(seqs, [9] * n)  # noqa: E731
            undo = lambda: [e.truncate(s, m) for s, m in zip(seqs, lens)]  # noqa: E731
        else:
            s = e.new_sequence()
            call = e.forward if kind == "prefill_ms" else e.forward_last
            fn, undo = (lambda: call(s, self.prefill[:n])), (lambda: e.free(s))
        c, t = time.process_time(), time.perf_counter()
        fn()
        wall, cpu = (time.perf_counter() - t) * 1e3, (time.process_time() - c) * 1e3
        undo()
        return wall, cpu


def check_equal(model, rng) -> dict:
    """After vs before on the real weights: one prompt, then a few steps and a verify call."""
    from edge.engines.torch_engine import TorchEngine
    a, b = TorchEngine(model, fast=False, threads=1), TorchEngine(model, fast=True, threads=1)
    p = rng.integers(100, model.cfg.vocab_size, 40).tolist()
    sa, sb = a.new_sequence(), b.new_sequence()
    pairs = [(a.forward(sa, p), b.forward(sb, p))]
    for t in (11, 12, 13):
        pairs.append((a.step([sa], [t]), b.step([sb], [t])))
    pairs.append((a.forward(sa, [5, 6, 7, 8]), b.forward(sb, [5, 6, 7, 8])))
    x = np.concatenate([u for u, _ in pairs])
    y = np.concatenate([w for _, w in pairs])
    return {"max_abs_diff": float(np.abs(x - y).max()), "logit_scale": float(np.abs(x).max()),
            "argmax_agree": float((x.argmax(-1) == y.argmax(-1)).mean()), "rows": int(len(x))}


def bench_model(name: str, repeats: int, variants: list, seed: int) -> dict:
    from edge.model.checkpoint import load_model
    from edge.model.fetch import model_path
    if not model_path(name).exists():
        return {"error": f"{model_path(name)} is missing; run `make models`"}
    model, _ = load_model(name)
    rng = np.random.default_rng(seed)
    eq = check_equal(model, rng)
    print(f"  {name}: after vs before max|diff| {eq['max_abs_diff']:.2e}, argmax agreement "
          f"{eq['argmax_agree']:.3f}", flush=True)
    vs = {v: Variant(model, *VARIANTS[v], rng) for v in variants}
    raw = {v: {} for v in variants}
    cpu = {v: {} for v in variants}
    bw = []
    order = list(variants)
    shuffle = random.Random(seed)
    for r in range(repeats):
        bw.append(copy_bandwidth_gbs())
        # variants take turns call by call, so a change in the machine's load hits them alike
        for kind, n in vs[variants[0]].items():
            shuffle.shuffle(order)
            for v in order:
                w, c = vs[v].measure(kind, n)
                raw[v].setdefault(kind, {}).setdefault(n, []).append(w)
                cpu[v].setdefault(kind, {}).setdefault(n, []).append(c)
        b1 = {v: statistics.median(raw[v]["step_ms"][1]) for v in variants}
        print(f"  {name} repeat {r + 1}/{repeats}: batch-1 step ms so far "
              + ", ".join(f"{v} {b1[v]:.0f}" for v in variants), flush=True)
    med = {v: _medians(raw[v]) for v in variants}
    for v in variants:
        med[v]["prefill_ms"], med[v]["prefill_last_ms"] = med[v]["prefill_ms"][PROMPT], med[v]["prefill_last_ms"][PROMPT]
        med[v]["cpu_ms"] = _medians(cpu[v])
    wb = weight_bytes(model)
    bw_med, bw_best = statistics.median(bw), max(bw)
    for v in variants:
        m = med[v]
        m["bound_ratio"] = (wb / bw_med / 1e6) / m["step_ms"][1]   # fraction of the bandwidth bound
        m["tok_s"] = {B: 1e3 * B / m["step_ms"][B] for B in BATCHES}
        m["verify_rel"] = {k: m["verify_ms"][k] / m["verify_ms"][1] for k in KS}
    return {"weight_bytes": wb, "bandwidth_gbs_median": bw_med, "bandwidth_gbs_best": bw_best,
            "bound_ms_median_bw": wb / bw_med / 1e6, "bound_ms_best_bw": wb / bw_best / 1e6,
            "equality": eq, "variants": med, "raw_wall_ms": raw, "raw_cpu_ms": cpu}


def _medians(d):
    return {k: _medians(v) if isinstance(v, dict) else statistics.median(v) for k, v in d.items()}


def table(res: dict, variants: list) -> str:
    lines = []
    for name, r in res.items():
        if "error" in r:
            lines += [f"### {name}", "", r["error"], ""]
            continue
        lines += [f"### {name} (fp32, {r['weight_bytes'] / 1e6:.0f} MB of weights read per step)", "",
                  f"Bandwidth (numpy copy, read + write): median {r['bandwidth_gbs_median']:.1f} GB/s, best "
                  f"{r['bandwidth_gbs_best']:.1f} GB/s -> batch-1 bound {r['bound_ms_median_bw']:.0f} ms "
                  f"(median bw) / {r['bound_ms_best_bw']:.0f} ms (best bw). After vs before logits: "
                  f"max |diff| {r['equality']['max_abs_diff']:.1e} (logits up to "
                  f"{r['equality']['logit_scale']:.0f}), argmax agreement {r['equality']['argmax_agree']:.3f}.", ""]
        head = ["measure"] + variants
        lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        V = r["variants"]

        def row(label, f):
            lines.append("| " + label + " | " + " | ".join(f(V[v]) for v in variants) + " |")
        row("batch-1 step, ms", lambda m: f"{m['step_ms'][1]:.0f}")
        row("% of bandwidth bound", lambda m: f"{100 * m['bound_ratio']:.0f}%")
        row("batch-1 step, process cpu ms", lambda m: f"{m['cpu_ms']['step_ms'][1]:.0f}")
        for k in KS[1:]:
            row(f"call over k={k}, ms (x one token)", lambda m, k=k: f"{m['verify_ms'][k]:.0f} ({m['verify_rel'][k]:.1f}x)")
        for B in BATCHES[1:]:
            row(f"step B={B}, ms (total tok/s)", lambda m, B=B: f"{m['step_ms'][B]:.0f} ({m['tok_s'][B]:.0f})")
        row(f"prefill {PROMPT}, forward, ms", lambda m: f"{m['prefill_ms']:.0f}")
        row(f"prefill {PROMPT}, forward_last, ms", lambda m: f"{m['prefill_last_ms']:.0f}")
        lines.append("")
    return "\n".join(lines)


def plot(res: dict, variants: list, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    ok = {n: r for n, r in res.items() if "error" not in r}
    fig, ax = plt.subplots(len(ok), 3, figsize=(16, 4.5 * len(ok)), squeeze=False)
    for i, (name, r) in enumerate(ok.items()):
        V = r["variants"]
        x = np.arange(len(variants))
        ax[i, 0].bar(x, [V[v]["step_ms"][1] for v in variants])
        ax[i, 0].axhline(r["bound_ms_median_bw"], color="red", ls="--", label="bandwidth bound (median bw)")
        ax[i, 0].set_xticks(x, variants)
        ax[i, 0].set_ylabel("batch-1 step, ms")
        ax[i, 0].set_title(name)
        ax[i, 0].legend(fontsize=7)
        for v in variants:
            ax[i, 1].plot(KS, [V[v]["verify_ms"][k] for k in KS], marker="o", label=v)
            ax[i, 2].plot(BATCHES, [V[v]["tok_s"][B] for B in BATCHES], marker="o", label=v)
        ax[i, 1].set_xlabel("tokens in one call (k)")
        ax[i, 1].set_ylabel("ms per call")
        ax[i, 2].set_xlabel("batch B (ragged)")
        ax[i, 2].set_ylabel("total tokens/s")
        ax[i, 2].set_xscale("log", base=2)
        ax[i, 1].legend(fontsize=7)
        ax[i, 2].legend(fontsize=7)
    fig.suptitle(f"torch engine, before vs after ({platform.node()}, {os.cpu_count()} cpus, shared)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--variants", default=DEFAULT_VARIANTS, help=f"from {', '.join(VARIANTS)}")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(result_stem("torch_engine_costs")), help="results path without suffix")
    a = ap.parse_args()
    variants = a.variants.split(",")
    bad = [v for v in variants if v not in VARIANTS]
    if bad:
        ap.error(f"unknown variant {bad[0]!r}; choose from {', '.join(VARIANTS)}")
    import torch
    load0 = os.getloadavg()
    res = {}
    for name in a.models.split(","):
        print(f"{name}:", flush=True)
        res[name] = bench_model(name, a.repeats, variants, a.seed)
    meta = {"node": platform.node(), "cpus": os.cpu_count(), "torch": torch.__version__,
            "loadavg_start": load0, "loadavg_end": os.getloadavg(), "repeats": a.repeats,
            "variants": {v: {"fast": VARIANTS[v][0], "threads": VARIANTS[v][1]} for v in variants}}
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps({"meta": meta, "models": res}, indent=1))
    plot(res, variants, out.with_suffix(".png"))
    md = (f"## torch engine: before vs after (medians of {a.repeats} interleaved repeats)\n\n"
          f"Machine: {os.cpu_count()} cpus, shared; load average {load0[0]:.1f} at start, "
          f"{meta['loadavg_end'][0]:.1f} at end -- numbers are noisy, compare columns within a row.\n"
          f"`before` = reference path (`fast=False`), `after` = fast path; `@n` = torch threads.\n\n"
          + table(res, variants))
    out.with_suffix(".md").write_text(md)
    print(md)


if __name__ == "__main__":
    main()
