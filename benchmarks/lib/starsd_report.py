"""Planner overlay, plot and markdown for benchmarks/star/starsd_scaling.py."""
from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import numpy as np

from server.planner import Prediction, SystemInputs, format_table, n_full, simulate, sweep

DRAFT_MB = 491.4          # Qwen2.5-Coder-0.5B Q4_K_M weights, per draft instance (results without "draft_mb")


def _stored(config: dict) -> str:
    """The draft file's storage format as the report names it."""
    fmt = config.get("draft_format", "native")
    return "Q4_K_M" if fmt == "native" else f"stored as {fmt} (from Q4_K_M)"


def _inputs(step_ms: dict, a, timing, alpha: float, over_ms: float) -> SystemInputs:
    return SystemInputs(draft_step_ms=step_ms, draft_feed_ms=0.0, target_step_ms=timing.target_step_ms,
                        verify_cost={k: timing.verify_cost(k) for k in range(1, max(a.gamma, 8) + 2)},
                        rtt_ms=timing.net_rtt_ms + over_ms, alpha=alpha)


def _measured(points: list, gamma: int, alone_tps: float) -> list:
    return [Prediction(n=p["n"], gamma=gamma, system_tps=p["system_tps"], per_target_tps=p["per_target_tps_mean"],
                       standalone_tps=alone_tps, busy_ratio=p.get("busy_ratio", 0.0),
                       mean_batch=p.get("mean_batch", 0.0), s_d_ms=p.get("s_d_ms", 0.0),
                       t_idle_ms=p.get("t_idle_ms", 0.0), iteration_ms=p.get("iteration_ms", 0.0))
            for p in points]


def planner_predictions(out: dict, a, timing, alpha: float) -> dict:
    """The planner fed with the draft service's measured D(b) (per-step = D(b)/gamma, no separate feed)."""
    over = (out["overhead"].get(a.broker) or {}).get("overhead_median_ms") or 0.0
    micro = {int(b): ms / a.gamma for b, ms in out["service_ms"].items()}
    inp = _inputs(micro, a, timing, alpha, max(0.0, over))
    preds = [simulate(inp, n, a.gamma) for n in a.ns]
    res = {"inputs": asdict(inp), "predicted": [asdict(p) for p in preds], "n_full_predicted": n_full(preds),
           "table": format_table(preds),
           "best_gamma": [{"n": p.n, "gamma": p.gamma, "system_tps": p.system_tps}
                          for p in sweep(inp, a.ns, range(1, 9))]}
    # the same model fed with the engine steps the draft actually made during the sweep (older
    # results: its batches, γ steps each)
    merged: dict = {}
    for p in out["points"]:
        d = p.get("draft") or {}
        per_step = "step_of_b" in d
        for b, v in (d["step_of_b"] if per_step else d.get("s_of_d", {})).items():
            m = merged.setdefault(int(b), [0, 0.0])
            count = v["steps"] if per_step else v["batches"]
            m[0] += count if per_step else count * a.gamma
            m[1] += v["mean_s"] * count
    if merged:
        inrun = {b: 1e3 * s / c for b, (c, s) in sorted(merged.items()) if c}
        preds2 = [simulate(_inputs(inrun, a, timing, alpha, max(0.0, over)), n, a.gamma) for n in a.ns]
        res["predicted_inrun"] = [asdict(p) for p in preds2]
        res["n_full_predicted_inrun"] = n_full(preds2)
        res["inrun_service_ms"] = {str(b): v * a.gamma for b, v in inrun.items()}
    alone = out["baselines"]["alone"]["system_tps"]
    if out["points"]:
        res["n_full_measured"] = n_full(_measured(out["points"], a.gamma, alone))
    return res


def _goals(out: dict) -> list:
    pts = sorted(out["points"], key=lambda p: p["n"])
    pl = out["planner"]
    if not pts:
        return []
    nf = pl.get("n_full_measured", pts[-1]["n"])
    one = pts[0]["system_tps"] / pts[0]["n"]
    lin = [p["system_tps"] / (p["n"] * one) for p in pts if p["n"] <= nf and one > 0]
    busy = [p.get("busy_ratio", 0) for p in pts if p["n"] > nf]
    ns = [p["n"] for p in pts]
    off = abs(ns.index(nf) - ns.index(pl["n_full_predicted"])) if pl["n_full_predicted"] in ns else None
    mq = (out["overhead"].get("mosquitto") or {}).get("overhead_median_ms")
    return [
        ("system ≥ 0.85 × linear up to N_full", f"min {min(lin):.2f}" if lin else "-", bool(lin) and min(lin) >= 0.85),
        ("draft busy ≥ 90% beyond N_full", f"min {min(busy):.0%}" if busy else "no point beyond N_full",
         bool(busy) and min(busy) >= 0.9),
        ("planner N_full within ±1 of measured", f"predicted {pl['n_full_predicted']}, measured {nf}"
         + (f" ({off} grid step(s) apart)" if off is not None else ""), off is not None and off <= 1),
        ("overhead ≤ 1 ms median on Mosquitto", f"{mq:.2f} ms" if mq is not None else "-", mq is not None and mq <= 1.0),
    ]


def _f(x, fmt=".1f", dash="-"):
    return dash if x is None or (isinstance(x, float) and not np.isfinite(x)) else format(x, fmt)


def markdown(out: dict) -> str:
    c, t, pl = out["config"], out["timing"], out["planner"]
    alone = out["baselines"]["alone"]["system_tps"]
    coloc = out["baselines"]["colocated"]["system_tps"]
    pred = {p["n"]: p for p in pl["predicted"]}
    nf = pl.get("n_full_measured")
    m = out["machine"]
    L = [f"# StarSD scaling: one draft service, N targets (γ={c['gamma']}, {c['broker']} broker)", "",
         f"Draft: **measured** — Qwen2.5-Coder-0.5B {_stored(c)} on the {c['draft_backend']} engine "
         f"({c['draft_threads']} threads) in the real hub/draft service, on this {m['cpus']}-core machine. "
         f"Targets: **emulated** {t.get('label') or t['profile'] + ' running Qwen2.5-Coder-1.5B Q4_K_M'} "
         f"({t['source']}{', step set by --target-step-ms' if c.get('target_step_ms') else ''}): "
         f"step {t['target_step_ms']:.1f} ms, verify cost " + ", ".join(f"k={k}: {v:.2f}" for k, v in
                                                                       t["verify_cost"].items())
         + f", network RTT {t['net_rtt_ms']:.1f} ms (emulated), acceptance α={out['alpha']['alpha']:.3f} "
         f"({out['alpha']['source']}), i.i.d. per position. Protocol, broker, HMAC, target loop and "
         f"verification are the real code. Targets {'always wait for the draft' if c['deadline'] == 'wait' else 'use the adaptive deadline'}"
         f"{'; draft-ahead on' if c['ahead'] else ''}. " + _method(out), "",
         f"Machine load average {m['loadavg_start'][0]:.1f} at start, {m['loadavg_end'][0]:.1f} at end "
         f"({m['date']}, {m['wall_s'] / 60:.1f} min). Per-token latency = round time / tokens of that round.", "",
         "| N | system tok/s | planner | per-target tok/s | planner | vs target-only | vs co-located | draft busy (pred) "
         "| mean batch | S(d) ms | T_idle ms (pred) | TPOT p50 / p99 ms | TPOT var ms² | accept | overhead ms | regime |",
         "|" + "---|" * 16]
    for p in sorted(out["points"], key=lambda p: p["n"]):
        q = pred.get(p["n"], {})
        regime = "" if nf is None else ("fully loaded" if p["n"] >= nf else "under-loaded")
        L.append(f"| {p['n']} | {p['system_tps']:.1f} | {_f(q.get('system_tps'))} | {p['per_target_tps_mean']:.2f} | "
                 f"{_f(q.get('per_target_tps'), '.2f')} | {p['per_target_tps_mean'] / alone:.2f}x | "
                 f"{p['per_target_tps_mean'] / coloc:.2f}x | {_f(p.get('busy_ratio'), '.0%')} ({_f(q.get('busy_ratio'), '.0%')}) | "
                 f"{_f(p.get('mean_batch'))} | {_f(p.get('s_d_ms'))} | {_f(p.get('t_idle_ms'))} ({_f(q.get('t_idle_ms'))}) | "
                 f"{_f(p.get('tpot_p50_ms'))} / {_f(p.get('tpot_p99_ms'))} | {_f(p.get('tpot_var_ms2'), '.0f')} | "
                 f"{_f(p.get('acceptance'), '.2f')} | {_f(p.get('overhead_median_ms'), '.2f')} | {regime} |")
    g, a_ = c["gamma"], out["alpha"]["alpha"]
    e = (1 - a_ ** (g + 1)) / (1 - a_) if a_ < 1 else g + 1
    L += ["", f"N_full: measured **{nf}**, planner **{pl['n_full_predicted']}** (planner fed with the draft "
          "service's micro-benchmarked batch time D(b) below, the profile's target costs, α, network + measured "
          f"overhead); the same planner fed with the D(b) the draft showed during the sweep: "
          f"N_full **{pl.get('n_full_predicted_inrun', '-')}**, system tok/s "
          + ", ".join(f"N={p['n']}: {p['system_tps']:.1f}" for p in pl.get("predicted_inrun", [])) + ".",
          "", f"accept = accepted / drafted tokens; with i.i.d. α={a_:.2f} and γ={g} it is (E−1)/γ = "
          f"{(e - 1) / g:.2f} (E = {e:.2f} tokens per round). Overhead at large N includes the queue of replies "
          "the draft node signs and publishes one after another after each batch.",
          "", f"Baselines (emulated on the same profile, same run): target-only **{alone:.1f} tok/s** per device; "
          f"co-located pair (0.5B draft on the device, {t['draft_step_on_device_ms']:.1f} ms/step, same γ) "
          f"**{coloc:.1f} tok/s** per device, acceptance {_f(out['baselines']['colocated'].get('acceptance'), '.2f')}. "
          f"N devices = N × one (they share nothing); N co-located pairs hold "
          f"N × {out.get('draft_mb', DRAFT_MB):.0f} MB of draft weights, StarSD one.", "", "Draft service time per batch D(b) (γ drafts per request):", "",
          "| batch | micro-benchmark ms | in the sweep ms |", "|---|---|---|"]
    inrun = pl.get("inrun_service_ms", {})
    for b in sorted({int(x) for x in out["service_ms"]} | {int(x) for x in inrun}):
        L.append(f"| {b} | {_f(out['service_ms'].get(str(b)))} | {_f(inrun.get(str(b)))} |")
    L += ["", "Protocol overhead (draft round trip − DraftResponse.compute_us, N=1, no emulated network):", "",
          "| broker | median ms | p90 ms | answers |", "|---|---|---|---|"]
    for b, o in out["overhead"].items():
        L.append(f"| {b} | {_f(o.get('overhead_median_ms'), '.2f')} | {_f(o.get('overhead_p90_ms'), '.2f')} | "
                 f"{o.get('overhead_samples') or 0} |")
    if out["real"]:
        L += ["", "Real targets (Qwen2.5-Coder-1.5B on llama.cpp, sharing this machine with the draft):", "",
              "| N | mode | system tok/s | acceptance | tokens/round |", "|---|---|---|---|---|"]
        for p in out["real"]:
            L.append(f"| {p['n']} | {p['mode']} | {p['system_tps']:.2f} | {_f(p.get('acceptance'), '.2f')} | "
                     f"{p['tokens_per_round']:.2f} |")
    L += ["", "Goals (issue 3):", "", "| goal | value | met |", "|---|---|---|"]
    L += [f"| {g} | {v} | {'yes' if ok else 'no'} |" for g, v, ok in _goals(out)]
    L += ["", "Planner at the run's γ:", "", pl["table"], "",
          "Planner's best γ per N: " + ", ".join(f"N={b['n']}: γ={b['gamma']}" for b in pl["best_gamma"]), ""]
    bad = [p for p in out["points"] if p.get("draft_batches", 0) < 5]
    if bad:
        L.append("**Noisy:** fewer than 5 draft batches in the window at N = "
                 + ", ".join(str(p["n"]) for p in bad) + "; rerun with a longer --seconds.")
    return "\n".join(L) + "\n"


def plot(out: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    pts = sorted(out["points"], key=lambda p: p["n"])
    pl = out["planner"]
    ns = np.array([p["n"] for p in pts])
    pred = {p["n"]: p for p in pl["predicted"]}
    alone = out["baselines"]["alone"]["system_tps"]
    coloc = out["baselines"]["colocated"]["system_tps"]
    nf, nfp = pl.get("n_full_measured"), pl["n_full_predicted"]
    fig, ax = plt.subplots(1, 3, figsize=(17, 5))
    for a_ in ax:
        a_.set_xscale("log", base=2)
        a_.set_xlabel("targets N")
        if nf is not None:
            a_.axvspan(ns.min() / 1.3, nf, color="tab:green", alpha=0.06, label="under-loaded")
            a_.axvspan(nf, ns.max() * 1.3, color="tab:red", alpha=0.06, label="fully loaded")
            a_.axvline(nf, color="tab:red", ls="-", lw=1, label=f"N_full measured = {nf}")
        a_.axvline(nfp, color="tab:purple", ls=":", lw=1.5, label=f"N_full planner = {nfp}")
    a0, a1, a2 = ax
    a0.plot(ns, [p["system_tps"] for p in pts], "o-", color="tab:blue", label="StarSD measured")
    a0.plot(ns, [pred[n]["system_tps"] for n in ns], "s--", color="tab:purple", label="planner (measured D(b))")
    if "predicted_inrun" in pl:
        a0.plot(ns, [p["system_tps"] for p in pl["predicted_inrun"]], "x:", color="tab:pink",
                label=f"planner (in-sweep D(b)), N_full = {pl.get('n_full_predicted_inrun')}")
    a0.plot(ns, ns * coloc, "--", color="tab:orange", label="N co-located pairs")
    a0.plot(ns, ns * alone, ":", color="gray", label="N × target-only")
    for p in out["real"]:
        a0.plot([p["n"]], [p["system_tps"]], "*" if p["mode"] == "star" else "P", ms=12,
                color="tab:green" if p["mode"] == "star" else "black", label=f"real 1.5B targets, {p['mode']}")
    a0.set_yscale("log")
    a0.set_ylabel("system tokens/s")
    a0.set_title("system throughput")
    a0.legend(fontsize=7)
    a1.plot(ns, [p["per_target_tps_mean"] for p in pts], "o-", color="tab:blue", label="per target, measured")
    a1.plot(ns, [pred[n]["per_target_tps"] for n in ns], "s--", color="tab:purple", label="per target, planner")
    a1.axhline(alone, color="gray", ls=":", label="target-only")
    a1.axhline(coloc, color="tab:orange", ls="--", label="co-located pair")
    a1.set_ylabel("tokens/s per target")
    a1b = a1.twinx()
    a1b.plot(ns, [p.get("busy_ratio", 0) for p in pts], "^-", color="tab:red", label="draft busy, measured")
    a1b.plot(ns, [pred[n]["busy_ratio"] for n in ns], "v:", color="tab:red", alpha=0.5, label="draft busy, planner")
    a1b.set_ylim(0, 1.05)
    a1b.set_ylabel("draft busy ratio")
    a1.set_title("per target / draft busy")
    h1, l1 = a1.get_legend_handles_labels()
    h2, l2 = a1b.get_legend_handles_labels()
    a1.legend(h1 + h2, l1 + l2, fontsize=7)
    a2.plot(ns, [p.get("tpot_p50_ms", np.nan) for p in pts], "o-", label="per-token latency p50")
    a2.plot(ns, [p.get("tpot_p99_ms", np.nan) for p in pts], "o--", label="p99")
    a2.plot(ns, [p.get("t_idle_ms", np.nan) for p in pts], "^-", label="T_idle measured")
    a2.plot(ns, [pred[n]["t_idle_ms"] for n in ns], "v:", label="T_idle planner")
    a2.set_yscale("symlog", linthresh=1.0)
    a2.set_ylabel("ms")
    a2.set_title("latency and draft idle time per iteration")
    a2.legend(fontsize=7)
    fig.suptitle(f"StarSD: one {out['config']['draft_backend']} 0.5B draft, N emulated "
                 f"{out['timing']['profile']} targets (γ={out['config']['gamma']}, α={out['alpha']['alpha']:.2f})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _method(out: dict) -> str:
    """How the draft served and how the sweep measured (results before these options say less)."""
    c, pts = out["config"], out["points"]
    said = ("Requests join the draft's batch at its next engine step (--join)." if c.get("join")
            else "The draft serves whole batches: a request waits for the batch in flight (--no-join).")
    if pts and "targets_cpu" in pts[0]:
        said += (" Accepted drafts a round are drawn from a low-discrepancy sequence (same mean at every N),"
                 " and a window starts after every target's prefill; the targets' process (all N on one"
                 f" core) used at most {max(p['targets_cpu'] for p in pts):.0%} of it.")
    return said


def write_outputs(out: dict, base: Path) -> list:
    base.parent.mkdir(parents=True, exist_ok=True)
    paths = [base.with_suffix(".json"), base.with_suffix(".md"), base.with_suffix(".png")]
    paths[0].write_text(json.dumps(out, indent=1, default=float))
    paths[1].write_text(markdown(out))
    plot(out, paths[2])
    return paths
