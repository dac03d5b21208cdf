"""A fleet of StarSD targets over K hubs and M draft services: a discrete-event simulation fed by
measured costs, checked against a measured small star before it is trusted at 10,000.

Inputs: the broker's cost per routed message (benchmarks/star/broker_costs.py's JSON), the draft's
D(b) (measured on this machine by starsd_scaling, or a GPU hub profile's roofline: named as such),
the targets' step and verify costs (a device profile: the Jetson Orin Nano), acceptance from
docs/models.md's measured agreement. Outputs per (N, K, M): per-target speedup over decoding alone,
draft busy, broker load per node, p50/p99 round trip; and, per K, the smallest M at which a
target still gains --goal. First, per measured starsd_scaling run given (--validate), the
simulator fed with that run's own costs beside what the run measured.

    python -m benchmarks.star.fleet_sim [--n 10000] [--validate RUN.json,...]
Writes benchmarks/results/fleet_sim/<variant>.{json,md,png} (--out; default `default`).
"""
from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

from benchmarks.lib.fleet_inputs import (DATA_ALPHA, broker_cost, draft_measured, draft_roofline, fleet_inputs,
                                         target_costs)
from benchmarks.lib.fleet_report import markdown, plot
from benchmarks.lib.fleet_search import search
from benchmarks.lib.fleet_validate import validate
from benchmarks.lib.results import RESULTS, result_stem
from edge.telemetry.cpu_info import cpu_name

LEFT_OUT = [
    "prefills and joins: a session's start (its prompt fed to the draft, the hub's join) is not simulated; "
    "the measured runs open their windows after every prefill too",
    "QoS 0 losses and the targets' deadlines: a target always waits for its answer (starsd_scaling's "
    "--deadline wait); a real target decodes alone when the draft is late, which bounds its loss",
    "the draft's feed of each request (one or a few tokens) inside its steps: a step's time is the measured "
    "(or roofline) batched step at the batch size, whatever the request fed",
    "the draft node's signing and publishing of each reply one after another after a batch",
    "broker latency apart from its queue: the broker is one FIFO server per node at its CPU cost per "
    "message, measured on loopback; cluster forwarding between nodes is not modelled (no round crosses nodes)",
    "acceptance i.i.d. per position at one α; real prompts vary (code agrees more than chat)",
    "the GPU hub's D(b) is a profile roofline (public figures), not a measurement: no GPU was lent to this task",
]


def args_of(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=10_000, help="targets in the fleet")
    ap.add_argument("--ks", default="1,2,4,5,8,10,20,25,40", help="hubs (broker nodes) tried; each divides N")
    ap.add_argument("--per-hub", default="1,2,4,8,16,32", help="draft services per hub tried")
    ap.add_argument("--goal", type=float, default=1.3, help="per-target speedup over decoding alone")
    ap.add_argument("--profile", default="jetson-orin-nano-8gb", help="the targets' device profile")
    ap.add_argument("--hub-profiles", dest="hubs", default="h200,rtx4090-workstation",
                    help="GPU hub profiles whose draft roofline to try (comma-separated)")
    ap.add_argument("--measured-draft", default=str(RESULTS / "starsd_scaling" / "pinned_xeon_f16_targets_join.json"),
                    help="a starsd_scaling JSON whose measured (CPU) draft D(b) to try too ('' for none)")
    ap.add_argument("--broker-costs", default=str(result_stem("broker_costs")) + ".json")
    ap.add_argument("--broker-kind", dest="broker", default="mosquitto", choices=["mosquitto", "rabbitmq"],
                    help="whose measured cost per routed message a broker node pays")
    ap.add_argument("--validate", default=",".join(str(RESULTS / "fleet_sim" / f) for f in
                                                   ("measured_star_orin.json",)) + "," +
                    str(RESULTS / "starsd_scaling" / "pinned_xeon_f16_targets_join.json"),
                    help="starsd_scaling JSONs to check the simulator against")
    ap.add_argument("--alpha", type=float, default=DATA_ALPHA)
    ap.add_argument("--gamma", type=int, default=4)
    ap.add_argument("--net-ms", type=float, default=1.0, help="device <-> broker, one way (2 ms round trip)")
    ap.add_argument("--hub-net-ms", type=float, default=0.1, help="draft service <-> broker, one way")
    ap.add_argument("--context", type=int, default=512, help="mean context the draft reads per session (roofline)")
    ap.add_argument("--seconds", type=float, default=2.0, help="simulated window per fleet point")
    ap.add_argument("--warmup", type=float, default=0.5)
    ap.add_argument("--validate-seconds", type=float, default=120.0)
    ap.add_argument("--out", default=str(result_stem("fleet_sim")))
    return ap.parse_args(argv)


def main(argv=None) -> None:
    a = args_of(argv)
    t0 = time.time()
    broker = broker_cost(Path(a.broker_costs), a.broker)
    target = target_costs(a.profile)
    out = {"n": a.n, "goal": a.goal, "window_s": a.seconds, "warmup_s": a.warmup, "left_out": LEFT_OUT,
           "inputs": {"target": target, "alpha": a.alpha, "gamma": a.gamma, "broker": broker, "net_ms": a.net_ms,
                      "hub_net_ms": a.hub_net_ms,
                      "alpha_source": "docs/models.md: Qwen2.5-Coder 0.5B vs 1.5B greedy agreement, 0.64-0.72 on MT-bench"},
           "validation": [], "fleets": {}}
    for path in [p for p in a.validate.split(",") if p and Path(p).exists()]:
        v = validate(Path(path), broker["broker_msg_ms"], a.validate_seconds)
        out["validation"].append(v)
        print(f"validated against {path}: " + ", ".join(f"N={r['n']} {r['err_sweep_tps']:+.0%}" for r in v["rows"]),
              flush=True)
    drafts = {f"{h} (roofline)": draft_roofline(h, a.context) for h in a.hubs.split(",") if h}
    if a.measured_draft and Path(a.measured_draft).exists():
        drafts["2-core EPYC/Xeon CPU (measured)"] = draft_measured(Path(a.measured_draft), a.gamma)
    ks = [int(k) for k in a.ks.split(",") if k]
    per_hub = [int(r) for r in a.per_hub.split(",") if r]
    for name, draft in drafts.items():
        inp = fleet_inputs(target, draft, a.alpha, a.gamma, a.net_ms, a.hub_net_ms, broker["broker_msg_ms"])
        s = search(inp, a.n, ks, a.goal, per_hub, a.warmup * 1e3, a.seconds * 1e3)
        out["fleets"][name] = {"n": a.n, "draft_source": draft["source"], "draft_step_ms": draft["draft_step_ms"],
                               "max_sessions": draft.get("max_sessions"), "search": s}
        ans = s["answer"]
        print(f"{name}: " + (f"K={ans['k']} M={ans['m']} speedup {ans['speedup']:.2f}" if ans else "no (K, M) meets the goal"),
              flush=True)
    out["machine"] = {"cpu": cpu_name(), "cpus": os.cpu_count(), "wall_s": time.time() - t0,
                      "date": time.strftime("%Y-%m-%d %H:%M"), "note": "a shared 2-core AMD EPYC"}
    stem = Path(a.out)
    stem.parent.mkdir(parents=True, exist_ok=True)
    stem.with_suffix(".json").write_text(json.dumps(out, indent=1, default=str))
    stem.with_suffix(".md").write_text(markdown(out))
    plot(out, stem.with_suffix(".png"))
    print(f"wrote {stem}.json, .md, .png", flush=True)


if __name__ == "__main__":
    main()
