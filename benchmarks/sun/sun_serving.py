"""SUN serving: isolated decode pools (one decoder per specialist) vs one shared pool with half the decoders.

Four task specialists; task popularity is Zipf(s) over the four (s=0 uniform);
requests arrive as a Poisson process. Each request: its task's prefill worker
makes the KV blob + first token (real PrefillWorker), the blob goes to a decode
worker (real SharedDecoder over a TorchEngine) which batches every sequence it
holds in one engine.step per token.

* isolated: 4 decoders, decoder i serves only task i (conventional
  disaggregated multi-model serving: decode is tied to its model);
* shared (SUN): 2 decoders serve all tasks; a KV goes to the least-loaded one.

Workers are separate machines in the model, so the simulation keeps one
virtual clock per worker: every real engine call is timed and advances only
its own worker's clock; nothing overlaps in real time, so the 2 shared cores
never time two workers at once. Reported: throughput per decode worker, TTFT
(arrival -> first token, which the prefill makes) and TPOT (later tokens)
p50/p99, SLO attainment (TTFT <= ttft_slo and TPOT <= tpot_slo).

  python -m benchmarks.sun.sun_serving                  # tiny-ish random model, ~10 min on 2 busy cores
  python -m benchmarks.sun.sun_serving --quick          # a 1-minute smoke
Run from the repository root. Writes benchmarks/results/sun_serving/<variant>.{json,png,md}
(--out; default: the variant `default`).
"""
from __future__ import annotations

import argparse
import copy
import json
import platform
import statistics
import time
from pathlib import Path

import numpy as np
import torch

from benchmarks.lib.results import result_stem
from edge.engines.torch_engine import TorchEngine
from edge.model.transformer import ModelConfig, Transformer
from edge.sun.decoder import SharedDecoder
from edge.sun.prefill import PrefillWorker
from edge.model.sun_modules import weights_fingerprint

TASKS = ("maths", "code", "tools", "chat")


def make_models(args):
    cfg = ModelConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.hidden * 3,
                      num_layers=args.layers, num_heads=args.hidden // 64, num_kv_heads=max(1, args.hidden // 256),
                      max_position=1024)
    torch.manual_seed(0)
    base = Transformer(cfg).eval()
    specs = {}
    for i, t in enumerate(TASKS):  # stand-ins for tuned specialists: same shape, other weights
        m = copy.deepcopy(base)
        g = torch.Generator().manual_seed(i + 1)
        for p in m.parameters():
            p.data.add_(torch.randn(p.shape, generator=g) * 0.01)
        specs[t] = m
    return base, specs


def zipf_probs(s: float, n: int) -> np.ndarray:
    w = 1.0 / np.arange(1, n + 1) ** s
    return w / w.sum()


def workload(rate: float, skew: float, n: int, args, seed: int):
    rng = np.random.default_rng(seed)
    t = np.cumsum(rng.exponential(1.0 / rate, size=n))
    tasks = rng.choice(len(TASKS), size=n, p=zipf_probs(skew, len(TASKS)))
    return [dict(id=f"r{i}", t=float(t[i]), task=TASKS[tasks[i]],
                 prompt=rng.integers(0, args.vocab,
                                     size=int(rng.integers(args.prompt_min, args.prompt_max + 1))).tolist(),
                 out=int(rng.integers(args.out_min, args.out_max + 1))) for i in range(n)]


class Worker:
    """A decode worker with its own virtual clock and the KVs routed to it but not yet admitted."""

    def __init__(self, dec: SharedDecoder, cost=None):
        self.dec, self.clock, self.queue, self.busy = dec, 0.0, [], 0.0
        self.cost = cost  # batch size -> seconds (calibrated), or None: the wall time of the real step

    @property
    def load(self) -> int:
        return self.dec.load + len(self.queue)

    def step(self, stats) -> None:
        while self.queue and self.queue[0][0] <= self.clock:
            _, r, blob = self.queue.pop(0)
            self.dec.admit(blob, request_id=r["id"], max_new=r["out"])
        n = min(self.dec.load, self.dec.max_batch)
        t0 = time.perf_counter()
        events = self.dec.step()
        dt = time.perf_counter() - t0 if self.cost is None else self.cost(n)
        self.clock += dt
        self.busy += dt
        for ev in events:
            if ev.done:
                stats[ev.request_id]["finish"] = self.clock


def simulate(config: str, reqs, base, specs, args, cal=None):
    step_cost = prefill_cost = None
    if cal is not None:  # the calibrated cost curves: both configurations see the same costs
        step_cost = lambda b: float(np.interp(b, cal["batch"], cal["step_s"]))  # noqa: E731
        prefill_cost = lambda n: float(np.interp(n, cal["prompt_len"], cal["prefill_s"]))  # noqa: E731
    base_fp = weights_fingerprint(base)
    if config == "shared":
        prefill = {t: PrefillWorker(TorchEngine(specs[t], fingerprint=base_fp), t) for t in TASKS}
        workers = [Worker(SharedDecoder(TorchEngine(base, fingerprint=base_fp), max_batch=args.max_batch),
                          step_cost) for _ in range(args.shared_decoders)]
        route = lambda task: min(workers, key=lambda w: w.load)  # noqa: E731  model-agnostic, least loaded
    else:  # each specialist decodes its own KV: one decoder per task
        fps = {t: weights_fingerprint(specs[t]) for t in TASKS}
        prefill = {t: PrefillWorker(TorchEngine(specs[t], fingerprint=fps[t]), t) for t in TASKS}
        by_task = {t: Worker(SharedDecoder(TorchEngine(specs[t], fingerprint=fps[t]), max_batch=args.max_batch),
                             step_cost) for t in TASKS}
        workers = list(by_task.values())
        route = lambda task: by_task[task]  # noqa: E731
    pclock = {t: 0.0 for t in TASKS}
    stats = {r["id"]: {"arrival": r["t"], "task": r["task"], "out": r["out"]} for r in reqs}
    ready = []  # prefill: one FIFO worker per task (the same in both configurations)
    for r in reqs:
        start = max(pclock[r["task"]], r["t"])
        res = prefill[r["task"]].prefill(r["prompt"], request_id=r["id"])
        took = res.prefill_s if prefill_cost is None else prefill_cost(len(r["prompt"]))
        pclock[r["task"]] = stats[r["id"]]["first"] = start + took
        ready.append((pclock[r["task"]], r, res.blob))
    ready.sort(key=lambda x: x[0])
    # decode: a discrete-event loop over the workers' clocks; a KV is routed when it is ready
    i = 0
    while True:
        busy = [w for w in workers if w.load]
        tw = min((w.clock for w in busy), default=float("inf"))
        if i < len(ready) and ready[i][0] <= tw:
            w = route(ready[i][1]["task"])
            if not w.load:
                w.clock = max(w.clock, ready[i][0])
            w.queue.append(ready[i])
            i += 1
        elif busy:
            min(busy, key=lambda w: w.clock).step(stats)
        else:
            break
    return stats, workers


def summarise(stats, workers, args, slo_ttft, slo_tpot):
    ttft = [s["first"] - s["arrival"] for s in stats.values()]
    tpot = [(s["finish"] - s["first"]) / max(1, s["out"] - 1) for s in stats.values()]
    span = max(s["finish"] for s in stats.values()) - min(s["arrival"] for s in stats.values())
    tokens = sum(s["out"] for s in stats.values())
    pct = lambda xs, q: float(np.percentile(xs, q))  # noqa: E731
    ok = [a <= slo_ttft and b <= slo_tpot for a, b in zip(ttft, tpot)]
    return {"decoders": len(workers), "tokens": tokens, "span_s": span,
            "throughput_tok_s": tokens / span, "per_decoder_tok_s": tokens / span / len(workers),
            "decoder_util": statistics.mean(w.busy / span for w in workers),
            "ttft_p50": pct(ttft, 50), "ttft_p99": pct(ttft, 99),
            "tpot_p50": pct(tpot, 50), "tpot_p99": pct(tpot, 99), "slo_attainment": sum(ok) / len(ok)}


def calibrate(base, args):
    """Medians of real engine calls: decode step time vs batch size, prefill time vs prompt length."""
    eng = TorchEngine(base, fingerprint="cal")
    mid = (args.prompt_min + args.prompt_max) // 2 + (args.out_min + args.out_max) // 4
    seqs = [eng.new_sequence() for _ in range(args.max_batch)]
    for s in seqs:
        eng.forward(s, list(range(1, mid + 1)))

    def med(f, n):
        ts = []
        for _ in range(n):
            t0 = time.perf_counter()
            f()
            ts.append(time.perf_counter() - t0)
        return statistics.median(ts)

    batch = sorted({1, 2, 4, 8, 16, args.max_batch} - {b for b in (16,) if b > args.max_batch})
    step_s = []
    for b in batch:
        step_s.append(med(lambda: eng.step(seqs[:b], [1] * b), args.repeats))
        for s in seqs[:b]:
            eng.truncate(s, mid)
    lens = [args.prompt_min, args.prompt_max]
    pre = [med(lambda: eng.forward(eng.new_sequence(), list(range(1, n + 1))), max(3, args.repeats // 2))
           for n in lens]
    return {"batch": batch, "step_s": step_s, "prompt_len": lens, "prefill_s": pre,
            "capacity_tok_s_per_decoder": args.max_batch / step_s[-1]}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--requests", type=int, default=160)
    ap.add_argument("--prompt-min", type=int, default=32)
    ap.add_argument("--prompt-max", type=int, default=128)
    ap.add_argument("--out-min", type=int, default=16)
    ap.add_argument("--out-max", type=int, default=48)
    ap.add_argument("--max-batch", type=int, default=32)
    ap.add_argument("--shared-decoders", type=int, default=2)
    ap.add_argument("--skews", type=float, nargs="+", default=[0.0, 1.0, 2.0])
    ap.add_argument("--loads", type=float, nargs="+", default=[0.25, 0.5, 0.8],
                    help="offered load as a fraction of the SHARED pool's calibrated capacity")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=9, help="calibration repeats (medians)")
    ap.add_argument("--clock", choices=("model", "wall"), default="model",
                    help="model: advance each worker by the calibrated cost of its real call (same costs "
                         "for both configurations, robust to a noisy machine); wall: by the call's own wall time")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default=str(result_stem("sun_serving")), help="results path without suffix")
    args = ap.parse_args(argv)
    if args.quick:
        args.hidden, args.layers, args.requests, args.skews, args.loads = 256, 4, 48, [0.0, 2.0], [0.5]
        args.repeats = 3
    torch.set_num_threads(args.threads)
    base, specs = make_models(args)
    cal = calibrate(base, args)
    print("calibration", json.dumps(cal), flush=True)
    mean_out = (args.out_min + args.out_max) / 2
    # SLOs relative to this machine: TPOT within a half-full batch's step, TTFT within 5 long prefills
    slo_tpot = float(np.interp(args.max_batch / 2, cal["batch"], cal["step_s"]))
    slo_ttft = 5 * cal["prefill_s"][-1]
    runs = []
    for skew in args.skews:
        for load in args.loads:
            rate = load * args.shared_decoders * cal["capacity_tok_s_per_decoder"] / mean_out
            reqs = workload(rate, skew, args.requests, args, seed=int(skew * 100 + load * 1000))
            row = {"skew": skew, "load": load, "rate_req_s": rate}
            for config in ("isolated", "shared"):
                stats, workers = simulate(config, reqs, base, specs, args,
                                          cal if args.clock == "model" else None)
                row[config] = summarise(stats, workers, args, slo_ttft, slo_tpot)
            iso, sh = row["isolated"], row["shared"]
            row["per_decoder_ratio"] = sh["per_decoder_tok_s"] / iso["per_decoder_tok_s"]
            row["tpot_p50_ratio"] = sh["tpot_p50"] / iso["tpot_p50"]
            runs.append(row)
            print(f"skew {skew} load {load}: per-decoder x{row['per_decoder_ratio']:.2f}, "
                  f"TPOT p50 x{row['tpot_p50_ratio']:.2f}, SLO iso {iso['slo_attainment']:.2f} "
                  f"shared {sh['slo_attainment']:.2f}", flush=True)
    result = {"machine": platform.platform(), "processor": platform.processor(), "threads": args.threads,
              "clock": args.clock,
              "args": vars(args), "calibration": cal, "slo": {"ttft_s": slo_ttft, "tpot_s": slo_tpot}, "runs": runs}
    write(result, Path(args.out))


def write(result, out: Path):
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(result, indent=1))
    lines = ["| skew | load | config | decoders | tok/s per decoder | TTFT p50/p99 (ms) | TPOT p50/p99 (ms) "
             "| SLO | per-decoder x | TPOT p50 x |",
             "|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in result["runs"]:
        for c in ("isolated", "shared"):
            s = r[c]
            extra = (f"{r['per_decoder_ratio']:.2f} | {r['tpot_p50_ratio']:.2f}" if c == "shared" else " | ")
            lines.append(f"| {r['skew']} | {r['load']} | {c} | {s['decoders']} | {s['per_decoder_tok_s']:.1f} | "
                         f"{1e3 * s['ttft_p50']:.0f}/{1e3 * s['ttft_p99']:.0f} | "
                         f"{1e3 * s['tpot_p50']:.1f}/{1e3 * s['tpot_p99']:.1f} | {s['slo_attainment']:.2f} | {extra} |")
    head = (f"# SUN serving: isolated vs shared decode pools\n\nMachine: {result['machine']}, torch threads "
            f"{result['threads']}, clock {result['clock']}. "
            f"SLO: TTFT <= {1e3 * result['slo']['ttft_s']:.0f} ms, TPOT <= "
            f"{1e3 * result['slo']['tpot_s']:.1f} ms. Load = offered tokens/s over the shared pool's calibrated "
            f"capacity.\n\n")
    out.with_suffix(".md").write_text(head + "\n".join(lines) + "\n")
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(1, 2, figsize=(10, 4))
    for skew in sorted({r["skew"] for r in result["runs"]}):
        rs = [r for r in result["runs"] if r["skew"] == skew]
        ax[0].plot([r["load"] for r in rs], [r["per_decoder_ratio"] for r in rs], "o-", label=f"zipf s={skew}")
        ax[1].plot([r["load"] for r in rs], [r["tpot_p50_ratio"] for r in rs], "o-", label=f"zipf s={skew}")
    ax[0].axhline(2.0, ls="--", c="grey"); ax[0].set_ylabel("throughput per decoder, shared / isolated")
    ax[1].axhline(1.05, ls="--", c="grey"); ax[1].set_ylabel("TPOT p50, shared / isolated")
    for a in ax:
        a.set_xlabel("offered load (fraction of shared capacity)"); a.legend()
    fig.tight_layout()
    fig.savefig(out.with_suffix(".png"), dpi=100)
    print(out.with_suffix(".md").read_text())


if __name__ == "__main__":
    main()
