"""What one StarSD round costs the broker, and how many such messages one broker node carries.

1. A real star through a real Mosquitto (the hub with the real 0.5B draft service, the real 1.5B
   target on llama.cpp), a counting subscriber on `#`: messages and bytes per round, per target,
   by topic and message tag, greedy and sampled (sampled answers carry the exact top-k q).
2. One broker node under emulated targets (benchmarks/lib/fleet_broker_load.py): many paho
   clients publishing round-shaped messages at the measured sizes and QoS, draft echoes
   answering; routed messages per second, and per second of the broker's own CPU (the clients
   share the same 2 cores, so the second figure is what a core of broker carries).
   The same on one RabbitMQ 3.10 node with its MQTT plugin (benchmarks/lib/fleet_rabbit.py),
   where rabbitmq-server is installed.

    python -m benchmarks.star.broker_costs [--quick] [--out benchmarks/results/broker_costs/default]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

from benchmarks.lib.fleet_broker_load import run_load
from benchmarks.lib.fleet_round_count import ROUND_MESSAGES, count_star
from benchmarks.lib.results import result_stem
from edge.telemetry.cpu_info import cpu_name


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def count_rounds(a) -> dict:
    """Messages and bytes per round on a real star, greedy and sampled."""
    from benchmarks.lib.scaling_sweep import DRAFT, TARGET, load_draft, mtbench_prompts
    from edge.engines.llamacpp_engine import LlamaCppEngine
    from edge.model.fetch import model_path
    from edge.speculative.sampling import GREEDY, SamplingParams
    from edge.star.draft_service import DraftLimits
    from edge.wire.link import MqttLink
    from server.hub import Hub
    from server.mosquitto import MosquittoBroker

    draft, tok = load_draft("llamacpp", 1, slots=4, max_len=1024, fmt="Q4_0")
    target = LlamaCppEngine(model_path(TARGET), max_len=1024, n_seq_max=1, threads=1)
    prompts = mtbench_prompts(tok, 96)[:a.prompts]
    out = {"draft": f"{DRAFT} Q4_0 (llama.cpp)", "target": f"{TARGET} Q4_K_M (llama.cpp)", "gamma": a.gamma}
    for name, params in (("greedy", GREEDY), ("sampled", SamplingParams(temperature=0.8, top_k=40, seed=1))):
        broker = MosquittoBroker().start()
        try:
            res = count_star(lambda cid: MqttLink(broker.url, client_id=cid),
                             lambda: Hub(broker_url=broker.url, draft_engine=draft, tokenizer_fp=tok.fingerprint(),
                                         limits=DraftLimits(ahead=False), status_every=60.0).start(),
                             target, tok.fingerprint(), prompts, a.new, params, gamma=a.gamma)
        finally:
            broker.stop()
        out[name] = res
        log(f"{name}: {res['rounds']} rounds, {res['round_messages']:.2f} messages / round, "
            f"{res['round_payload_bytes']:.0f} B payload, {res['round_wire_bytes']:.0f} B on the wire")
    target.close()
    return out


def broker_load(a, req_bytes: int, resp_bytes: int) -> dict:
    """Round-shaped load on one Mosquitto node, then on one RabbitMQ 3.10 MQTT node."""
    from benchmarks.lib.fleet_rabbit import RabbitNode, available
    from server.mosquitto import MosquittoBroker
    out = {}
    for name in a.brokers:
        why = available() if name == "rabbitmq" else None
        if why:
            out[name] = {"skipped": why}
            log(f"{name}: skipped: {why}")
            continue
        broker = (RabbitNode() if name == "rabbitmq" else MosquittoBroker()).start()
        pid = broker.beam_pid() if name == "rabbitmq" else broker.proc.pid
        out[name] = {"points": []}
        try:
            for targets in a.targets:
                services = max(1, targets // 64)
                p = run_load(broker.url, pid, targets, services, req_bytes, resp_bytes,
                             window=a.window, seconds=a.seconds)
                out[name]["points"].append(p)
                log(f"{name}, {targets} targets / {services} echoes: {p['routed_msgs_per_s']:.0f} routed msgs/s, "
                    f"broker {p['broker_cpu_share']:.0%} of a core -> {p['routed_msgs_per_broker_cpu_s']:.0f} per CPU s")
        finally:
            broker.stop()
    return out


def write(out: dict, stem: Path) -> list:
    stem.parent.mkdir(parents=True, exist_ok=True)
    stem.with_suffix(".json").write_text(json.dumps(out, indent=1))
    stem.with_suffix(".md").write_text(markdown(out))
    plot(out, stem.with_suffix(".png"))
    return [stem.with_suffix(s) for s in (".json", ".md", ".png")]


def markdown(out: dict) -> str:
    r = out["rounds"]
    lines = ["# Broker costs of StarSD rounds", "",
             f"Run {out['machine']['date']} on {out['machine']['cpu']} ({out['machine']['cpus']} cores, "
             "**shared** with other work: load average "
             f"{out['machine']['loadavg_start'][0]:.1f} at start, {out['machine']['loadavg_end'][0]:.1f} at end), "
             "Mosquitto on loopback.", "",
             "## One round, per target (a real star: " + f"{r['draft']} draft, {r['target']} target, γ={r['gamma']})", "",
             "The protocol's round: " + ", ".join(f"`{k}` {t} (QoS {q})" for k, t, q in ROUND_MESSAGES) +
             "; the verify result rides in the next request (keep/append).", "",
             "| sampling | rounds | messages / round | payload B / round | wire B / round | request B (median) | "
             "answer B (median) | other messages / generation |", "|---|---|---|---|---|---|---|---|"]
    for name in ("greedy", "sampled"):
        s = r[name]
        ps = s["payload_sizes"]
        lines.append(f"| {name} | {s['rounds']} | {s['round_messages']:.2f} | {s['round_payload_bytes']:.0f} | "
                     f"{s['round_wire_bytes']:.0f} | {ps.get('up:draft_req', {}).get('median', '-')} | "
                     f"{ps.get('down:draft_resp', {}).get('median', '-')} | "
                     f"{s['setup_messages_per_generation']:.1f} ({', '.join(s['other_kinds'])}) |")
    lines += ["", "## One broker node under emulated targets", "",
              "Paho clients in 2 processes publish request-sized messages, echo clients answer with "
              f"answer-sized ones (QoS {ROUND_MESSAGES[0][2]}, {out['load_args']['window']} rounds in flight per "
              f"target, {out['load_args']['seconds']:.0f} s per point). The clients share the 2 cores with the "
              "broker, so the observed rate is the clients' limit; `per broker CPU s` is what one core of "
              "broker carries.", "",
              "| broker | targets | echo services | routed msgs/s | broker CPU | routed msgs per broker CPU s | MB/s |",
              "|---|---|---|---|---|---|---|"]
    for b, d in out["load"].items():
        if d.get("skipped"):
            lines.append(f"| {b} | not measured: {d['skipped']} | | | | | |")
        for p in d.get("points", []):
            lines.append(f"| {b} | {p['targets']} | {p['services']} | {p['routed_msgs_per_s']:.0f} | "
                         f"{p['broker_cpu_share']:.0%} | {p['routed_msgs_per_broker_cpu_s']:.0f} | "
                         f"{p['payload_mb_per_s']:.2f} |")
    lines += ["", out["rabbitmq_note"], ""]
    return "\n".join(lines)


def plot(out: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 4))
    for b, d in out["load"].items():
        pts = d.get("points", [])
        xs = [p["targets"] for p in pts]
        ax.plot(xs, [p["routed_msgs_per_s"] for p in pts], "o-", label=f"{b}: observed")
        ax.plot(xs, [p["routed_msgs_per_broker_cpu_s"] for p in pts], "s--", label=f"{b}: per broker CPU s")
    ax.set_xscale("log")
    ax.set_xlabel("emulated targets")
    ax.set_ylabel("routed messages / s")
    ax.set_title("One broker node, round-shaped messages (shared 2-core EPYC)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer prompts and load points")
    ap.add_argument("--prompts", type=int, default=3)
    ap.add_argument("--new", type=int, default=32, help="tokens per generation in the counted star")
    ap.add_argument("--gamma", type=int, default=4)
    ap.add_argument("--targets", default="16,64,256", help="emulated targets per load point")
    ap.add_argument("--brokers", default="mosquitto,rabbitmq")
    ap.add_argument("--window", type=int, default=2, help="rounds in flight per emulated target")
    ap.add_argument("--seconds", type=float, default=6.0)
    ap.add_argument("--out", default=str(result_stem("broker_costs")))
    a = ap.parse_args(argv)
    a.targets = [int(x) for x in a.targets.split(",") if x]
    a.brokers = [b for b in a.brokers.split(",") if b]
    if a.quick:
        a.prompts, a.targets, a.seconds = 2, a.targets[:2], 4.0
    load0, t0 = os.getloadavg(), time.time()
    out = {"rounds": count_rounds(a)}
    sizes = out["rounds"]["greedy"]["payload_sizes"]
    req = int(statistics.median([sizes["up:draft_req"]["median"], out["rounds"]["sampled"]["payload_sizes"]["up:draft_req"]["median"]]))
    resp = int(sizes["down:draft_resp"]["median"])
    out["load_args"] = {"req_bytes": req, "resp_bytes": resp, "window": a.window, "seconds": a.seconds}
    out["load"] = broker_load(a, req, resp)
    out["rabbitmq_note"] = ("RabbitMQ: one node (3.10, rabbitmq_mqtt, MQTT 3.1.1, QoS 0), started by "
                            "benchmarks/lib/fleet_rabbit.py; its CPU is the Erlang VM's (all its threads). "
                            + (out["load"].get("rabbitmq", {}).get("skipped") or ""))
    out["machine"] = {"cpu": cpu_name(), "cpus": os.cpu_count(), "loadavg_start": load0,
                      "loadavg_end": os.getloadavg(), "wall_s": time.time() - t0, "date": time.strftime("%Y-%m-%d %H:%M"),
                      "note": "a shared 2-core AMD EPYC: other engineers' work ran beside it"}
    log("wrote " + ", ".join(map(str, write(out, Path(a.out)))))


if __name__ == "__main__":
    main()
