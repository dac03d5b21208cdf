"""The star under faults: each network fault, process fault and attack run against a live star of
real processes in network namespaces, over TLS with the hub's ACL (harness/netns_star.py: hub +
Mosquitto, a remote draft service, targets dev1
(behind a delaying proxy) and dev2, the SUN prefill worker and shared decoder).

  sudo .venv/bin/python -m benchmarks.faults.faults [--requests 3] [--max-new 40] [--partition-s 3]
         [--long-partition-s 0] [--model NAME --dtype float32] [--only NAME ...] [--list]

Run from the repository root, as root. Writes benchmarks/results/faults/<variant>.{json,md,png}
(--out; default: the variant `default`). One row per fault:

* what was done and what happened;
* tokens lost (must be 0): tokens of a greedy output that differs from the no-fault output
  (a whole differing output counts as lost) or never came back within its timeout;
* forged messages accepted (must be 0), where the fault forges or tampers with something;
* recovery time: from the fault's end until the faulted device's session is drafted for again
  (the monitor, a hub-role client off the switch, sees its draft answers), or until a SUN
  request sent during the fault is served;
* peak memory: the largest VmHWM over the star's processes (Mosquitto included) after it;
* throughput: tokens/s of the faulted target's requests during the fault vs without a fault.

The faults live in benchmarks/lib/faults_network.py (latency, loss, pulled cables, tampering),
faults_process.py (kill -9 of the hub, the broker, a draft service, a SUN worker, a target; see
tests/system/test_process_faults.py) and faults_hostile.py (forged, replayed and oversized
messages from mosquitto_pub; see tests/system/test_hostile_clients.py). Adding faults: a module
benchmarks/lib/faults_<topic>.py with `FAULTS = [Fault(name, kind, run)]` (kind "network",
"process" or "attack"; run(bench) -> Outcome), named in FAULT_MODULES below.
benchmarks/lib/fault_bench.py's `Bench` gives them the star, the no-fault texts and the
measuring helpers.
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import platform
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import List

from benchmarks.lib import faults_network
from benchmarks.lib.fault_bench import SUN_PROMPTS, Bench, Fault
from benchmarks.lib.results import result_stem

# the network faults first, then the attacks and the process faults (the report's row order)
FAULT_MODULES = ("benchmarks.lib.faults_network", "benchmarks.lib.faults_hostile", "benchmarks.lib.faults_process")


# what this report does not cover yet, by kind: a module of FAULT_MODULES adding Faults of that
# kind takes the line off the report
PENDING = {
    "process": "kill -9 of the hub, Mosquitto, a draft service, a SUN decoder mid-stream, a SUN prefill "
               "worker, a target (as tests/system/test_process_faults.py does): add benchmarks/lib/faults_process.py",
    "attack": "forged HMACs, replays, other sessions' topics, oversized payloads, wrong dtypes, floods from "
              "mosquitto_pub (as tests/system/test_hostile_clients.py does): add benchmarks/lib/faults_hostile.py",
}


def all_faults() -> List[Fault]:
    """FAULTS of every module in FAULT_MODULES, in that order."""
    return [x for name in FAULT_MODULES for x in importlib.import_module(name).FAULTS]


# ---- report ------------------------------------------------------------------------------------

def write_report(rows: List[dict], meta: dict, out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))

    def f(x, fmt="{:.2f}"):
        return "–" if x is None else fmt.format(x)
    lines = ["# The star under faults", "",
             f"{meta['when']}, machine {meta['machine']} ({meta['cpus']} cpus), load average at start "
             f"{meta['load_start']} and end {meta['load_end']}" + (
                 ": **the machine was shared and loaded** at the start, so throughput and recovery times "
                 "are upper bounds. " if meta['load_start'][0] > 1.5 else
                 " (the star's own processes make up the load at the end; 2 cores run them all). ") +
             f"Model: {meta['model']}; {meta['requests']} requests of {meta['max_new']} tokens per case, "
             f"partitions of {meta['partition_s']} s. No-fault throughput: "
             + ", ".join(f"{h} {v:.0f} tok/s" for h, v in meta["base_tok_s"].items()) + ".", "",
             "| fault | kind | what happened | tokens lost | forged accepted | recovery s | peak MiB | "
             "tok/s (dev1) vs no fault | slowest request s |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        base = meta["base_tok_s"].get("t1")
        ratio = f"{r['tok_s']:.0f} ({r['tok_s'] / base:.2f}x)" if r.get("tok_s") and base else "–"
        lines.append(f"| {r['name']} | {r['kind']} | {r['happened']} | {r['tokens_lost']} / {r['tokens']} | "
                     f"{f(r['forged_accepted'], '{}')} | {f(r['recovery_s'])} | {f(r.get('peak_mb'), '{:.0f}')} | "
                     f"{ratio} | {f(r['max_request_s'])} |")
    builtin = {x.name for x in faults_network.FAULTS}    # the kinds no added module has covered yet
    covered = {r["kind"] for r in rows if r["name"] not in builtin}
    todo = [f"* not in this report yet ({k}): {v}" for k, v in PENDING.items() if k not in covered]
    if todo:
        lines += [""] + todo
    bad = [r["name"] for r in rows if r["tokens_lost"] or r["forged_accepted"]]
    lines += ["", "Every row must show 0 tokens lost and 0 forged messages accepted: "
              + ("**failed: " + ", ".join(bad) + "**" if bad else "all do."),
              "", "Recovery: from the fault's end until the faulted device's session is drafted for again "
              "(or a SUN request sent into the fault is served); the targets decode alone meanwhile. "
              "Forged accepted '–': the fault forges nothing. Peak MiB: the largest VmHWM over the star's "
              "processes so far (JSON: per process).",
              "", "Reading the throughput: a generation that starts while its target cannot reach the hub "
              "first waits its join timeout (StarTarget.join_timeout, 3 s) and then decodes alone, so the "
              "slowest requests under a partition take about 3 s plus decoding. With the tiny model a "
              "target decodes alone faster than one draft round trip, so added latency lowers its "
              "throughput; with real models the balance differs (run with --model)."]
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    names = [r["name"] for r in rows]
    fig, (a, b) = plt.subplots(1, 2, figsize=(13, 0.45 * len(rows) + 2), sharey=True)
    a.barh(names, [r.get("tok_s") or 0 for r in rows], color="tab:blue")
    if meta["base_tok_s"].get("t1"):
        a.axvline(meta["base_tok_s"]["t1"], color="k", ls="--", label="no fault")
        a.legend()
    a.set_xlabel("dev1 tokens/s during the fault")
    b.barh(names, [r["recovery_s"] or 0 for r in rows], color="tab:orange")
    b.set_xlabel("recovery time, s")
    a.invert_yaxis()
    fig.suptitle(f"StarSun under faults (tokens lost: {sum(r['tokens_lost'] for r in rows)}, "
                 f"loaded machine, {meta['model']})")
    fig.tight_layout()
    fig.savefig(out.with_suffix(".png"), dpi=100)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=3, help="requests per fault and per target")
    ap.add_argument("--max-new", type=int, default=40, help="tokens per request")
    ap.add_argument("--partition-s", type=float, default=3.0, help="a partition's length")
    ap.add_argument("--long-partition-s", type=float, default=0.0,
                    help="the long partition's length (> 22.5 s outlives MQTT's keepalive; 0: skip it)")
    ap.add_argument("--model", default=None, help="draft and target model (default: a tiny random llama)")
    ap.add_argument("--dtype", default="float64")
    ap.add_argument("--no-sun", action="store_true", help="leave out the SUN workers and their faults")
    ap.add_argument("--only", nargs="*", default=None, help="run only faults whose name contains one of these")
    ap.add_argument("--list", action="store_true", help="list the faults and exit")
    ap.add_argument("--out", default=str(result_stem("faults")), help="results path without suffix")
    a = ap.parse_args(argv)
    faults = [x for x in all_faults() if a.only is None or any(s.lower() in x.name.lower() for s in a.only)]
    faults = [x for x in faults if not (x.needs_sun and a.no_sun)
              and not ("long partition" in x.name and not a.long_partition_s)]
    if a.list:
        for x in faults:
            print(f"{x.kind:8} {x.name}")
        return
    from harness.netns import available
    why = available()
    if why:
        sys.exit(f"error: {why}")
    from harness.netns_star import NamespaceStar
    meta = {"when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "machine": platform.node(),
            "cpus": os.cpu_count(), "load_start": [round(x, 1) for x in os.getloadavg()],
            "model": a.model or "tiny random llama (float64)", "requests": a.requests, "max_new": a.max_new,
            "partition_s": a.partition_s}
    rows = []
    with tempfile.TemporaryDirectory(prefix="ss-faults-") as tmp:
        star = NamespaceStar(Path(tmp), sun=not a.no_sun, model=a.model, dtype=a.dtype,
                             telemetry_s=1.0)    # the services' dropped counts (faults_hostile.py)
        with star:
            b = Bench(star, a.requests, a.max_new, a.partition_s)
            b.long_partition_s = a.long_partition_s
            b.baseline()
            meta["base_tok_s"] = b.base_tok_s
            if not a.no_sun:
                from edge.wire.link import MqttLink
                from edge.sun.client import SunClient
                from harness.console_scripts import sun_reference
                b.sun = (SunClient(MqttLink(star.url, tls=star.tls("app")).connect(10), "app").start(),
                         [sun_reference(star.maths_dir, star.dec_dir, p, 24) for p in SUN_PROMPTS])
            for x in faults:
                print(f"{x.kind}: {x.name} ...", file=sys.stderr, flush=True)
                o = x.run(b)
                row = {"name": x.name, "kind": x.kind, **asdict(o), "peak_mb": max(star.peak_rss_mb().values()),
                       "peak_mb_by_process": star.peak_rss_mb()}
                print(f"  {o.happened}; lost {o.tokens_lost}/{o.tokens}, recovery {o.recovery_s}", file=sys.stderr)
                rows.append(row)
            if b.sun:
                b.sun[0].close()
                b.sun[0].link.close()
    meta["load_end"] = [round(x, 1) for x in os.getloadavg()]
    write_report(rows, meta, Path(a.out))
    print(f"wrote {a.out}.json, .md, .png", file=sys.stderr)


if __name__ == "__main__":
    main()
