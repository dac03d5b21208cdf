"""Load: does one draft service, and one shared SUN decoder, treat every session alike as N grows?

StarSD: N emulated targets (harness/load_targets.py: the real target code, its own MQTT
connection each, in a few processes; device cost from a profile, acceptance alpha) against ONE
real draft service (a tiny float64 llama, torch engine) in the real hub over a Mosquitto of
its own, configured for exactly N sessions. Once all N hold a session, 8 more clients ask for
one (refusals at the limit). Per point: the draft round trip (request -> answer, as each target
sees it) median and p99 over all requests, the worst session's p99 and its ratio to the
median (a starved session would stand out), the draft's batch sizes, how many batches a
request waited (1 = the next one), the peak RSS of this process (it hosts the draft service)
and the draft's KV. SUN: N mixed requests of three tasks at once on one shared decoder
(8 rows per step) and 4 whose KV is more than its max_pending_mb: per-request latency
median / p99 / ratio, rows per step, the longest wait for a row in steps vs round-robin's
bound ceil(load / max_batch), refusals, answers different from the one-process run.

    python -m benchmarks.load.load --quick            # N = 16, 64, 256; 1 generation of 32 tokens (~1 min)
    python -m benchmarks.load.load                    # N = 16..256; 2 generations of 64 tokens (a few min)
    python -m benchmarks.load.load --quick --out /tmp/load   # /tmp/load.{json,md,png}
Run from the repository root. Writes benchmarks/results/load/<variant>.{json,md,png} (--out; default:
the variant `default`). The load drivers (shared with tests/system/test_load.py): harness/load_*.py.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import time
from pathlib import Path

import numpy as np

from benchmarks.lib.results import result_stem
from edge.star.draft_service import DraftLimits
from harness.load_monitor import Monitor, rss_mb
from harness.load_star import LoadConfig, LoadStar
from harness.load_sun import SunPool, big_jobs, jobs, refusal_codes, wrong
from server.mosquitto import MosquittoBroker


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def ints(s: str) -> list:
    return [int(x) for x in s.split(",") if x.strip()]


def pct(xs, q) -> float:
    return float(np.percentile(xs, q)) if len(xs) else 0.0


def star_point(n: int, a, workdir: Path) -> dict:
    broker = MosquittoBroker().start()
    star = LoadStar(broker.url, DraftLimits(max_sessions=n, max_kv_mb=a.kv_mb), workdir=workdir)
    try:
        cfg = LoadConfig(n=n, procs=min(a.procs, n), max_sessions=n, max_kv_mb=a.kv_mb, max_new=a.max_new,
                         generations=a.generations, gamma=a.gamma, alpha=a.alpha, time_scale=a.time_scale,
                         record=False, extra_joins=a.extra)
        t0 = time.monotonic()
        run = star.run(cfg)
        wall = time.monotonic() - t0
    finally:
        star.close()
        broker.close()
    per = [np.array(t["latencies"]) * 1e3 for t in run.targets if t["latencies"]]
    allv = np.concatenate(per) if per else np.zeros(0)
    p50 = pct(allv, 50)
    worst = max(pct(x, 99) for x in per) if per else 0.0
    st, mon = run.stats, run.monitor
    return {"n": n, "wall_s": wall, "requests": int(allv.size), "lat_p50_ms": p50, "lat_p99_ms": pct(allv, 99),
            "p99_over_p50": pct(allv, 99) / p50 if p50 else 0.0, "worst_session_p99_ms": worst,
            "worst_over_p50": worst / p50 if p50 else 0.0,
            "session_p50_spread": (max(pct(x, 50) for x in per) / min(pct(x, 50) for x in per)) if per else 0.0,
            "batch_mean": st["batch_size_mean"], "batch_max": st["batch_size_max"],
            "waited_max": max(run.waited) if run.waited else 0, "busy_ratio": st["busy_ratio"],
            "peak_rss_mb": mon.peak("rss_mb"), "peak_kv_mb": mon.peak("kv_mb"),
            "peak_kv_alloc_mb": mon.peak("kv_alloc_mb"), "peak_sessions": mon.peak("sessions"),
            "refused_at_limit": sum(1 for r in run.extra if r), "asked_past_limit": len(run.extra),
            "refused_kv": st["counters"].get("refused_kv", 0),
            "errors": [t["error"] for t in run.targets if t["error"]][:5]}


def sun_point(n: int, a) -> dict:
    broker = MosquittoBroker().start()
    pool = SunPool(broker.url, max_batch=a.max_batch, max_pending_mb=0.25)
    try:
        todo, big = jobs(n, seed=n), big_jobs(4)
        for j in todo:
            pool.expect(*j)
        with Monitor({**pool.probes(), "rss_mb": rss_mb}) as mon:
            t0 = time.monotonic()
            res = pool.serve(todo)
            wall = time.monotonic() - t0
            res_big = pool.serve(big)
    finally:
        pool.close()
        broker.close()
    lat = np.array([r.total_s * 1e3 for r, e in res if r is not None])
    ttft = np.array([r.ttft_s * 1e3 for r, e in res if r is not None])
    p50 = pct(lat, 50)
    rows = pool.rows_per_step()
    d = pool.decoder
    return {"n": n, "wall_s": wall, "lat_p50_ms": p50, "lat_p99_ms": pct(lat, 99),
            "p99_over_p50": pct(lat, 99) / p50 if p50 else 0.0, "ttft_p50_ms": pct(ttft, 50),
            "ttft_p99_ms": pct(ttft, 99), "rows_mean": statistics.mean(rows) if rows else 0.0,
            "rows_max": max(rows) if rows else 0, "gap_max": max(d.gaps) if d.gaps else 0,
            "gap_bound": d.gap_bound(), "max_load": d.max_load, "peak_rss_mb": mon.peak("rss_mb"),
            "peak_pending_kb": mon.peak("dec_pending_bytes") / 1024, "refused_at_limit": refusal_codes(res_big).get(
                "overloaded", 0), "asked_past_limit": len(big), "wrong": len(wrong(pool, todo, res))}


def markdown(out: dict) -> str:
    m, a = out["meta"], out["args"]
    lines = [f"# Load: {m['when']}, {m['machine']} ({m['cpus']} cpus, load avg {m['loadavg']})", "",
             f"StarSD: N emulated targets ({a['profile']} x{a['time_scale']}, alpha {a['alpha']}, gamma {a['gamma']}, "
             f"{a['generations']} x {a['max_new']} tokens each) against ONE tiny-model draft service with "
             f"--max-sessions N; {a['extra']} more joins asked once all N hold a session. Latency = draft round trip "
             "per request as the target sees it. No session should be served much later than the rest: the "
             "worst session's p99 stays within a small factor of the median, and every request is served by "
             "the next batch (waited 1).", "",
             "| N | requests | p50 ms | p99 ms | p99/p50 | worst session p99 / p50 | batch mean / max | waited max "
             "| peak RSS MB | peak KV MB (alloc) | refused at the limit | KV refusals |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for p in out["star"]:
        lines.append(f"| {p['n']} | {p['requests']} | {p['lat_p50_ms']:.1f} | {p['lat_p99_ms']:.1f} | "
                     f"{p['p99_over_p50']:.2f} | {p['worst_over_p50']:.2f} | {p['batch_mean']:.1f} / {p['batch_max']} "
                     f"| {p['waited_max']} | {p['peak_rss_mb']:.0f} "
                     f"| {p['peak_kv_mb']:.2f} ({p['peak_kv_alloc_mb']:.2f}) "
                     f"| {p['refused_at_limit']} of {p['asked_past_limit']} | {p['refused_kv']} |")
    lines += ["", f"SUN: N mixed requests (3 tasks) at once on ONE shared decoder ({a['max_batch']} rows per step, "
              "0.25 MiB of KV in transit); 4 more whose KV alone is larger (refused: overloaded). Latency = "
              "request sent -> last token. Round-robin bound: no request waits more than ceil(load / rows) steps "
              "for its next row.", "",
              "| N | p50 ms | p99 ms | p99/p50 | TTFT p50 / p99 ms | rows mean / max | longest wait (bound) steps "
              "| peak RSS MB | peak KV in transit KiB | refused at the limit | wrong answers |",
              "|---|---|---|---|---|---|---|---|---|---|---|"]
    for p in out["sun"]:
        lines.append(f"| {p['n']} | {p['lat_p50_ms']:.1f} | {p['lat_p99_ms']:.1f} | {p['p99_over_p50']:.2f} | "
                     f"{p['ttft_p50_ms']:.1f} / {p['ttft_p99_ms']:.1f} | {p['rows_mean']:.1f} / {p['rows_max']} | "
                     f"{p['gap_max']} ({p['gap_bound']}) | {p['peak_rss_mb']:.0f} | {p['peak_pending_kb']:.0f} | "
                     f"{p['refused_at_limit']} of {p['asked_past_limit']} | {p['wrong']} |")
    lines += ["", "Peak RSS is this process's (the draft service, or the SUN router, prefill workers and decoder, "
              "plus torch); the targets and Mosquitto run in other processes. KV is what --max-kv-mb counts "
              "(what the engine holds, reserved ahead of each batch), KV (alloc) what the torch engine holds "
              "(it grows each sequence in doubling chunks from 64 tokens). Times on a shared CPU are noisy: "
              "read ratios, not absolutes."]
    return "\n".join(lines) + "\n"


def plot(out: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(1, 3, figsize=(15, 4.2))
    for name, pts, mark in (("StarSD draft round trip", out["star"], "o"), ("SUN request", out["sun"], "s")):
        ns = [p["n"] for p in pts]
        ax[0].plot(ns, [p["lat_p50_ms"] for p in pts], mark + "-", label=f"{name} p50")
        ax[0].plot(ns, [p["lat_p99_ms"] for p in pts], mark + "--", label=f"{name} p99")
        ax[1].plot(ns, [p["p99_over_p50"] for p in pts], mark + "-", label=f"{name} p99/p50")
    ns = [p["n"] for p in out["star"]]
    ax[1].plot(ns, [p["worst_over_p50"] for p in out["star"]], "o:", label="StarSD worst session p99 / p50")
    ax[2].plot(ns, [p["batch_mean"] for p in out["star"]], "o-", label="draft batch (mean)")
    ax[2].plot([p["n"] for p in out["sun"]], [p["rows_mean"] for p in out["sun"]], "s-", label="decoder rows (mean)")
    ax[0].set_yscale("log")
    for x, title, yl in zip(ax, ("latency", "tail / median", "batch"), ("ms", "ratio", "requests per step")):
        x.set_xscale("log", base=2)
        x.set_xlabel("concurrent sessions / requests N")
        x.set_ylabel(yl)
        x.set_title(title)
        x.grid(alpha=0.3)
        x.legend(fontsize=7)
    fig.suptitle(f"load on {out['meta']['machine']} ({out['meta']['cpus']} cpus)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="1 generation of 32 tokens per target")
    ap.add_argument("--ns", type=ints, default=None, help="StarSD sessions per point (16,32,64,128,256; "
                    "--quick 16,64,256)")
    ap.add_argument("--sun-ns", type=ints, default=None, help="SUN concurrent requests per point (likewise)")
    ap.add_argument("--procs", type=int, default=4, help="processes the targets are spread over")
    ap.add_argument("--max-new", type=int, default=64)
    ap.add_argument("--generations", type=int, default=2)
    ap.add_argument("--gamma", type=int, default=3)
    ap.add_argument("--alpha", type=float, default=0.7)
    ap.add_argument("--time-scale", type=float, default=0.25, help="emulated device time x this")
    ap.add_argument("--kv-mb", type=float, default=1024.0, help="the draft's --max-kv-mb")
    ap.add_argument("--max-batch", type=int, default=8, help="the SUN decoder's rows per step")
    ap.add_argument("--extra", type=int, default=8, help="joins asked past the session limit")
    ap.add_argument("--out", type=Path, default=result_stem("load"), help="results path without suffix")
    a = ap.parse_args(argv)
    if a.quick:
        a.max_new, a.generations = 32, 1
    points = [16, 64, 256] if a.quick else [16, 32, 64, 128, 256]
    a.ns, a.sun_ns = a.ns or points, a.sun_ns or points
    import torch
    torch.set_num_threads(1)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    work = Path(os.environ.get("TMPDIR", "/tmp")) / f"ss-load-{os.getpid()}"
    work.mkdir(parents=True, exist_ok=True)
    out = {"meta": {"when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "machine": platform.node(),
                    "cpus": os.cpu_count(), "loadavg": " ".join(f"{x:.2f}" for x in os.getloadavg())},
           "args": {**{k: (str(v) if isinstance(v, Path) else v) for k, v in vars(a).items()},
                    "profile": LoadConfig.profile}, "star": [], "sun": []}
    for n in a.ns:
        log(f"StarSD N={n}")
        p = star_point(n, a, work)
        log(f"  p50 {p['lat_p50_ms']:.1f} ms, p99 {p['lat_p99_ms']:.1f} ms, worst session {p['worst_over_p50']:.2f}x, "
            f"batch {p['batch_mean']:.1f}, refused {p['refused_at_limit']}/{p['asked_past_limit']}")
        out["star"].append(p)
    for n in a.sun_ns:
        log(f"SUN N={n}")
        p = sun_point(n, a)
        log(f"  p50 {p['lat_p50_ms']:.1f} ms, p99 {p['lat_p99_ms']:.1f} ms, rows {p['rows_mean']:.1f}, "
            f"gap {p['gap_max']} (bound {p['gap_bound']}), wrong {p['wrong']}")
        out["sun"].append(p)
    a.out.with_suffix(".json").write_text(json.dumps(out, indent=1))
    a.out.with_suffix(".md").write_text(markdown(out))
    plot(out, a.out.with_suffix(".png"))
    shutil.rmtree(work, ignore_errors=True)            # the workers' specs and stderr
    log(f"wrote {a.out}.json, .md, .png")


if __name__ == "__main__":
    main()
