"""A draft-service switch on and off, side by side in one run: batch coalescing
(--switch hold, edge/star/batch_hold.py) or the llama.cpp engine's stream gathering
(--switch gather, edge/engines/stream_placement.py).

One real draft service (the 0.5B on --draft-backend, pinned to core 1 with the hub) feeds N
emulated targets (benchmarks/star/starsd_scaling.py's: Jetson profile, real target code, the real
Mosquitto broker, pinned to core 0). For each N the points alternate between the service
holding a batch for sessions due back and serving at once (work-conserving), --rounds times
each, a fresh hold policy per point. Per N and mode: median system tok/s, mean batch size
and the protocol overhead (the round trip beyond the draft's own time: queueing included).
Sessions end after every point, so each point starts from empty KV streams.

Where a batch's time is mostly fixed cost (a memory-bound draft: torch float32 here, a GPU on
a hub) the held batches merge the groups that otherwise take turns; where it grows with its
size (llama.cpp Q4_0 on one core) the policy holds nothing and both modes should match.
Gathering off = the batch in arrival order on whatever slots its sessions hold: llama.cpp then
runs it as one ubatch per run of consecutive slots (the kit's behaviour before it).

    python -m benchmarks.star.draft_switch --draft-backend torch                       # ~6 min
    python -m benchmarks.star.draft_switch --draft-format Q4_0 --ns 1,2,4,8            # ~6 min
    python -m benchmarks.star.draft_switch --switch gather --ns 4,8,16                 # ~5 min
Run from the repository root. Writes benchmarks/results/draft_switch/{batch_hold,stream_gather}_<draft>.{json,png,md}
(--out: another directory). The sweep's parts: benchmarks/lib/scaling_sweep.py.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

from benchmarks.lib import scaling_sweep as sc
from benchmarks.lib.results import RESULTS
from edge.telemetry.cpu_info import cpu_name
from export.target_format import FORMATS
from harness.emulated_target import DeviceTiming

SWITCHES = {"hold": ("hold", "no hold"), "gather": ("gather", "no gather")}
STEMS = {"hold": "batch_hold", "gather": "stream_gather"}
TITLES = {"hold": "Batch coalescing", "gather": "Stream gathering (one ubatch a batch)"}


def args_of(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--switch", choices=sorted(SWITCHES), default="hold",
                    help="hold: batch coalescing; gather: llama.cpp stream gathering (llamacpp only)")
    ap.add_argument("--draft-backend", choices=["llamacpp", "torch"], default="llamacpp")
    ap.add_argument("--draft-format", default="Q4_0", choices=FORMATS, help="llamacpp: the draft GGUF's format")
    ap.add_argument("--draft-threads", type=int, default=1)
    ap.add_argument("--ns", type=sc.ints, default=[1, 2, 4])
    ap.add_argument("--rounds", type=int, default=2, help="points per N and mode (alternating)")
    ap.add_argument("--seconds", type=float, default=12.0, help="measurement window per point")
    ap.add_argument("--warmup", type=float, default=4.0)
    ap.add_argument("--profile", default="jetson-orin-nano-8gb")
    ap.add_argument("--out", default=str(RESULTS / "draft_switch"), help="results directory")
    a = ap.parse_args(argv)
    if a.switch == "gather" and a.draft_backend != "llamacpp":
        ap.error("--switch gather is a llama.cpp engine setting: use --draft-backend llamacpp")
    return a


def main(argv=None) -> None:
    from edge.star.batch_hold import BatchHold
    from edge.star.draft_service import DraftLimits
    from server.broker import MosquittoBroker
    from server.hub import Hub
    args = args_of(argv)
    a = sc.args_of(["--quick", "--pin", "--seconds", str(args.seconds), "--warmup", str(args.warmup),
                    "--profile", args.profile])
    os.sched_setaffinity(0, {1})          # the hub + draft: core 1 (the targets go to core 0)
    timing = DeviceTiming.from_profile(a.profile, a.net_rtt_ms, a.time_scale, a.verify)
    draft, tok = sc.load_draft(args.draft_backend, args.draft_threads, slots=2 * max(args.ns) + 4,
                               max_len=1536, fmt=args.draft_format)
    fp, vocab = tok.fingerprint(), draft.vocab_size
    prompts = sc.mtbench_prompts(tok, a.prompt_tokens)
    d_of_b = sc.measure_service(draft, args.ns, a.gamma, prompts, 2)
    r_ms = timing.call_ms(a.gamma + 1) + timing.net_rtt_ms
    lim = DraftLimits(max_sessions=2 * max(args.ns) + 4, max_gamma=8, ahead=False, evict_after_s=900)
    broker = MosquittoBroker().start()
    hub = Hub(broker_url=broker.url, draft_engine=draft, tokenizer_fp=fp, limits=lim, hub_id="bench").start()
    work, points = Path(tempfile.mkdtemp(prefix="hold-")), []
    t0 = time.time()
    try:
        modes = SWITCHES[args.switch]
        for n in args.ns:
            for r in range(args.rounds):
                for mode in (modes if r % 2 == 0 else modes[::-1]):
                    if args.switch == "hold":
                        hub.service.hold = BatchHold() if mode == "hold" else None
                    else:
                        draft.gather, draft.moves = mode == "gather", 0
                    spec = sc.stretch(sc.base_spec(a, "star", n, prompts, timing, sc.DATA_ALPHA, vocab, fp,
                                                   broker.url), 1e3 * d_of_b.get(n, max(d_of_b.values())), r_ms, a)
                    p = sc.run_point(spec, hub, work)
                    hold = hub.service.hold
                    p.update(policy=mode, holds=hold.holds if hold else 0, held_s=hold.held_s if hold else 0.0,
                             moves=getattr(draft, "moves", 0))
                    points.append(p)
                    sc.log(f"N={n} {mode}: system {p['system_tps']:.1f} tok/s, batch {p.get('mean_batch', 0):.1f}, "
                           f"overhead {p.get('overhead_median_ms', float('nan')):.1f} ms, holds {p['holds']}, "
                           f"moves {p['moves']}")
    finally:
        hub.stop()
        hub.service.step()
        (broker.close if hasattr(broker, "close") else broker.stop)()
    meta = dict(switch=args.switch, draft_backend=args.draft_backend, draft_format=args.draft_format,
                draft_threads=args.draft_threads,
                profile=args.profile, gamma=a.gamma, rounds=args.rounds, seconds=args.seconds, cpu=cpu_name(),
                service_ms={str(b): 1e3 * d for b, d in d_of_b.items()}, wall_s=time.time() - t0,
                date=time.strftime("%Y-%m-%d %H:%M"), loadavg_end=os.getloadavg())
    write(meta, points, args)


def table(points, ns, modes):
    med = lambda xs: statistics.median(xs) if xs else float("nan")  # noqa: E731
    rows = []
    for n in ns:
        by = {m: [p for p in points if p["n"] == n and p["policy"] == m] for m in modes}
        row = {"n": n}
        for m, ps in by.items():
            row[m] = dict(system_tps=med([p["system_tps"] for p in ps]),
                          mean_batch=med([p.get("mean_batch", 0.0) for p in ps]),
                          overhead_ms=med([p.get("overhead_median_ms", float("nan")) for p in ps]),
                          holds=sum(p["holds"] for p in ps), moves=sum(p.get("moves", 0) for p in ps))
        row["ratio"] = row[modes[0]]["system_tps"] / row[modes[1]]["system_tps"]
        rows.append(row)
    return rows


def write(meta, points, args) -> None:
    name = "torch" if args.draft_backend == "torch" else args.draft_format.lower()
    on, off = SWITCHES[args.switch]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = out / f"{STEMS[args.switch]}_{name}"
    rows = table(points, args.ns, (on, off))
    stem.with_suffix(".json").write_text(json.dumps(dict(meta=meta, table=rows, points=points), indent=1, default=str))
    draft = "torch float32" if args.draft_backend == "torch" else f"llama.cpp {args.draft_format}"
    ms = ", ".join(f"D({b}) {v:.0f}" for b, v in meta["service_ms"].items())
    count = "holds" if args.switch == "hold" else "stream moves"
    lines = [f"# {TITLES[args.switch]} on / off: Qwen2.5-Coder-0.5B draft ({draft}, {args.draft_threads} thread, "
             f"core 1), N emulated {args.profile} targets (core 0), γ={meta['gamma']}, Mosquitto\n",
             f"CPU: {meta['cpu']}. Medians of {args.rounds} points per N and mode, the modes alternating in one "
             f"run ({meta['date']}, {meta['wall_s'] / 60:.1f} min). Draft service time per batch (ms, "
             f"micro-benchmark, {on}): {ms}.\n",
             f"| N | {on}: system tok/s | {off}: system tok/s | {on} / {off} | mean batch ({on} / {off}) | "
             f"overhead ms ({on} / {off}) | {count} |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        h, o = r[on], r[off]
        lines.append(f"| {r['n']} | {h['system_tps']:.1f} | {o['system_tps']:.1f} | **{r['ratio']:.2f}×** | "
                     f"{h['mean_batch']:.1f} / {o['mean_batch']:.1f} | {h['overhead_ms']:.1f} / {o['overhead_ms']:.1f} "
                     f"| {h['holds'] if args.switch == 'hold' else h['moves']} |")
    lines.append("\nOverhead = the draft round trip − the draft's own time − the emulated network: the time a "
                 "request waited for another batch, plus the protocol.")
    if args.switch == "gather":
        lines.append(f"\n{off}: each batch in arrival order on the slots its sessions hold; llama.cpp runs it as "
                     "one ubatch per run of consecutive slots (edge/engines/stream_placement.py). New sessions "
                     "take the lowest free slot in both modes.")
    stem.with_suffix(".md").write_text("\n".join(lines) + "\n")
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6.5, 4))
    for m in (on, off):
        ax.plot([r["n"] for r in rows], [r[m]["system_tps"] for r in rows], "o-", label=m)
    ax.set_xlabel("targets N")
    ax.set_ylabel("system tok/s (median)")
    ax.set_title(f"{TITLES[args.switch]}, 0.5B draft on {draft}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(stem.with_suffix(".png"), dpi=110)
    print(stem.with_suffix(".md").read_text())


if __name__ == "__main__":
    main()
