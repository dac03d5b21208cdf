"""fleet_sim's markdown and plot (benchmarks/star/fleet_sim.py)."""
from __future__ import annotations

from pathlib import Path


def _fmt_point(p: dict) -> str:
    return (f"| {p['n']} | {p['k']} | {p['m']} | {p['speedup']:.2f}x | {p['per_target_tps']:.1f} | "
            f"{p['draft_busy']:.0%} | {p['mean_batch']:.1f} | {p['broker_msgs_per_s']:.0f} | {p['broker_load']:.2f} | "
            f"{p['rtt_p50_ms']:.1f} / {p['rtt_p99_ms']:.1f} | {p['sessions_per_service']:.0f}"
            f"{'' if p['fits'] else ' (no fit)'} |")


POINT_HEAD = ["| N | K hubs | M drafts | speedup | tok/s per target | draft busy | mean batch | "
              "routed msgs/s per node | broker load | round trip p50 / p99 ms | sessions per draft |",
              "|---|---|---|---|---|---|---|---|---|---|---|"]


def validation_md(v: dict) -> list:
    lines = [f"### {v['label']}", "", f"From `{v['file']}` (run {v['machine'].get('date', '?')}, load average "
             f"{(v['machine'].get('loadavg_start') or [float('nan')])[0]:.1f} → "
             f"{(v['machine'].get('loadavg_end') or [float('nan')])[0]:.1f}); the simulator fed with that run's "
             f"costs: α={v['inputs']['alpha']:.2f}, γ={v['inputs']['gamma']}, one-way network "
             f"{v['inputs']['net_ms']:.1f} ms, N=1 protocol overhead {v['inputs']['overhead_ms']:.2f} ms.", "",
             "| N | measured tok/s per target | sim (bench D(b)) | error | sim (in-sweep D(b)) | error | "
             "measured round ms | sim round ms (bench / sweep) | measured busy | sim busy (bench / sweep) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in v["rows"]:
        lines.append(f"| {r['n']} | {r['measured_tps']:.2f} | {r['sim_bench_tps']:.2f} | {r['err_bench_tps']:+.0%} | "
                     f"{r['sim_sweep_tps']:.2f} | {r['err_sweep_tps']:+.0%} | {r['measured_round_ms']:.0f} | "
                     f"{r['sim_bench_round_ms']:.0f} / {r['sim_sweep_round_ms']:.0f} | "
                     f"{(r['measured_busy'] or 0):.0%} | {r['sim_bench_busy']:.0%} / {r['sim_sweep_busy']:.0%} |")
    errs = [abs(r["err_sweep_tps"]) for r in v["rows"]]
    lines += ["", f"Largest |error| of per-target tok/s with the in-sweep D(b): {max(errs):.0%}"
              f"{' (within the 10% goal)' if max(errs) <= 0.10 else ' (NOT within the 10% goal)'}; "
              f"with the micro-benchmarked D(b): {max(abs(r['err_bench_tps']) for r in v['rows']):.0%}.", ""]
    return lines


def fleet_md(name: str, fleet: dict, goal: float) -> list:
    s = fleet["search"]
    lines = [f"### Draft hub: {name}", "", f"D(b): {fleet['draft_source']}", ""]
    a = s["answer"]
    if a:
        lines += [f"**N = {a['n']}: a target gains {a['speedup']:.2f}× (≥ {goal}×) with K = {a['k']} hubs and "
                  f"M = {a['m']} draft services**; the fewest hubs that reach {goal}× with any M tried: "
                  f"K = {s['min_k']}.", ""]
    else:
        lines += [f"**No (K, M) tried gives a target {goal}×** "
                  f"(best speedup seen: {max(p['speedup'] for p in s['tried']):.2f}×).", ""]
    lines += ["Smallest M per K (— : none tried reaches the goal):", "", *POINT_HEAD]
    for k, p in s["per_k"].items():
        lines.append(_fmt_point(p) if p else f"| {fleet['n']} | {k} | — | | | | | | | | |")
    lines += ["", "Every point tried:", "", *POINT_HEAD, *[_fmt_point(p) for p in s["tried"]], ""]
    return lines


def markdown(out: dict) -> str:
    inp = out["inputs"]
    lines = ["# Fleet simulation: N targets over K hubs and M draft services", "",
             f"Discrete-event simulation (benchmarks/lib/fleet_des.py), run {out['machine']['date']} on "
             f"{out['machine']['cpu']} (a shared 2-core AMD EPYC; the simulation's own time does not depend on it).",
             "", "## Inputs", "",
             f"* targets: {inp['target']['source']}: step {inp['target']['target_step_ms']:.1f} ms, verify of "
             f"γ+1={inp['gamma'] + 1} tokens {inp['target']['verify_cost'][inp['gamma'] + 1]:.2f} steps",
             f"* acceptance α = {inp['alpha']} ({inp['alpha_source']}), γ = {inp['gamma']}, drawn i.i.d. per position",
             f"* broker: {inp['broker']['source']}: {inp['broker']['capacity_msgs_per_s']:.0f} routed messages per "
             f"broker CPU second per node ({inp['broker']['broker_msg_ms'] * 1e3:.1f} µs each), 2 per round",
             f"* network: device ↔ broker {inp['net_ms']} ms one way, draft service ↔ broker {inp['hub_net_ms']} ms",
             f"* simulated: {out['window_s']} s after {out['warmup_s']} s of warm-up per point", "",
             "## Checked against a measured small star", ""]
    for v in out["validation"]:
        lines += validation_md(v)
    lines += ["## The fleet", ""]
    for name, fleet in out["fleets"].items():
        lines += fleet_md(name, fleet, out["goal"])
    lines += ["## What the model leaves out", "", *[f"* {x}" for x in out["left_out"]], ""]
    return "\n".join(lines)


def plot(out: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    for v in out["validation"]:
        ns = [r["n"] for r in v["rows"]]
        line, = ax1.plot(ns, [r["measured_tps"] for r in v["rows"]], "o-", label=f"measured: {v['label'][:30]}")
        ax1.plot(ns, [r["sim_sweep_tps"] for r in v["rows"]], "x--", color=line.get_color(), label="simulated")
    ax1.set_xlabel("targets N (one draft service)")
    ax1.set_ylabel("tok/s per target")
    ax1.set_title("simulator vs measured small star")
    ax1.legend(fontsize=7)
    for name, fleet in out["fleets"].items():
        tried = fleet["search"]["tried"]
        ks = sorted({p["k"] for p in tried})
        ax2.plot(ks, [max(p["speedup"] for p in tried if p["k"] == k) for k in ks], "o-", label=name)
    ax2.axhline(out["goal"], color="k", lw=0.8, ls=":")
    ax2.set_xlabel("hubs K (one broker node each)")
    ax2.set_ylabel("best per-target speedup over the M tried")
    ax2.set_title(f"N = {out['n']} Orin Nano targets")
    ax2.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
