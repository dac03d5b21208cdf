"""Where a StarSD draft round trip spends its time when the draft itself costs nothing.

For each broker (Mosquitto, embedded amqtt) on loopback, three medians over
--rounds round trips, measured side by side in one run:

* `mqtt`: the transport floor -- a bare paho-mqtt ping-pong between two
  clients through the broker (two hops, no StarSun code);
* `kit`: a real DraftRequest from a joined session (HubClient, edge/wire/protocol.py
  encode + HMAC, MqttLink) to the hub's draft service on a tiny model and back,
  minus the DraftResponse's own compute_us: the protocol overhead the StarSD
  issue asks to keep <= 1 ms median on Mosquitto;
* `codec`: encode + decode (msgpack, HMAC-SHA256 both ways) of one request and
  one response, in-process.

  python -m benchmarks.star.protocol_overhead [--rounds 400]

Run from the repository root. Writes benchmarks/results/protocol_overhead/<variant>.{json,md,png}
(--out; default: the variant `default`).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import threading
import time
from pathlib import Path

import numpy as np

from benchmarks.lib.results import result_stem


def start_broker(kind: str):
    from server.broker import EmbeddedBroker, MosquittoBroker
    return (MosquittoBroker() if kind == "mosquitto" else EmbeddedBroker()).start()


def mqtt_floor(url: str, rounds: int) -> list:
    """Round trips of a bare paho ping-pong (echo client on its own connection)."""
    import paho.mqtt.client as mqtt
    from edge.wire.link import parse_url
    host, port, _, _ = parse_url(url)
    got = threading.Event()

    def client(name):
        c = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=f"{name}-{os.getpid()}")
        c.connect(host, port)
        c.loop_start()
        return c
    echo, ping = client("echo"), client("ping")
    echo.on_message = lambda c, u, m: echo.publish("bench/pong", m.payload, qos=0)
    ping.on_message = lambda c, u, m: got.set()
    echo.subscribe("bench/ping", qos=0)
    ping.subscribe("bench/pong", qos=0)
    time.sleep(0.3)
    out = []
    payload = b"x" * 64
    for _ in range(rounds + 20):
        got.clear()
        t = time.perf_counter()
        ping.publish("bench/ping", payload, qos=0)
        if got.wait(2):
            out.append(time.perf_counter() - t)
    for c in (echo, ping):
        c.loop_stop()
        c.disconnect()
    return out[20:]


def kit_round_trips(url: str, rounds: int) -> list:
    """(round trip s, draft compute s) of DraftRequests through the hub's draft service."""
    import torch
    from edge.engines.torch_engine import TorchEngine
    from edge.wire.link import MqttLink
    from edge.model.transformer import Transformer, tiny_config
    from edge.wire.protocol import sampling
    from edge.star.draft_service import DraftLimits
    from edge.star.hub_client import HubClient
    from server.hub import Hub
    torch.manual_seed(0)
    model = Transformer(tiny_config("llama")).eval()
    hub = Hub(broker_url=url, draft_engine=TorchEngine(model, "draft"), tokenizer_fp="tok",
              limits=DraftLimits(ahead=False)).start()
    link = MqttLink(url).connect(5)
    client = HubClient(link, "bench", "tok", model.cfg.vocab_size).start()
    try:
        s = client.join(1, sampling(), timeout=10)
        ctx = [1, 2, 3]
        s.request(s.next_seq(), 0, ctx, 1, sampling())        # prefill, not timed
        out = []
        for i in range(rounds + 20):
            seq = s.next_seq()
            tok = 4 + i % 200
            t = time.perf_counter()
            s.request(seq, len(ctx), [tok], 1, sampling())     # its draft is rejected: feed one token
            got = s.wait(seq, time.monotonic() + 2)
            rtt = time.perf_counter() - t
            ctx.append(tok)
            if got is not None and hasattr(got[0], "compute_us"):
                out.append((rtt, got[0].compute_us / 1e6))
            if len(ctx) > 200:                                  # keep the draft's work constant
                ctx = ctx[:3]
                s.request(s.next_seq(), 3, [], 1, sampling())
                time.sleep(0.01)
        return out[20:]
    finally:
        client.close()
        link.close()
        hub.stop()


def codec_cost(rounds: int) -> list:
    from edge.wire.protocol import DraftRequest, DraftResponse, decode, encode, sampling
    key = os.urandom(32)
    req = DraftRequest("s" * 12, 7, 40, [5], 4, sampling())
    resp = DraftResponse("s" * 12, 7, [1, 2, 3, 4], None, 300)
    out = []
    for _ in range(rounds):
        t = time.perf_counter()
        decode(encode(req, key), key)
        decode(encode(resp, key), key)
        out.append(time.perf_counter() - t)
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=400)
    ap.add_argument("--brokers", default="mosquitto,embedded")
    ap.add_argument("--out", default=str(result_stem("protocol_overhead")), help="results path without suffix")
    a = ap.parse_args(argv)
    rows = []
    codec = np.array(codec_cost(2000)) * 1e3
    for kind in a.brokers.split(","):
        broker = start_broker(kind)
        try:
            floor = np.array(mqtt_floor(broker.url, a.rounds)) * 1e3
            kit = kit_round_trips(broker.url, a.rounds)
        finally:
            broker.stop()
        rtt = np.array([r for r, _ in kit]) * 1e3
        over = np.array([r - c for r, c in kit]) * 1e3
        rows.append({"broker": kind, "mqtt_ping_pong_ms": float(np.median(floor)),
                     "kit_round_trip_ms": float(np.median(rtt)), "draft_compute_ms": float(np.median(rtt - over)),
                     "overhead_ms": float(np.median(over)), "overhead_p90_ms": float(np.percentile(over, 90)),
                     "samples": int(over.size), "_over": over.tolist(), "_floor": floor.tolist()})
        print(f"{kind}: ping-pong {rows[-1]['mqtt_ping_pong_ms']:.2f} ms, kit overhead "
              f"{rows[-1]['overhead_ms']:.2f} ms (p90 {rows[-1]['overhead_p90_ms']:.2f})", flush=True)
    meta = {"machine": platform.node(), "cpus": os.cpu_count(), "load_avg": os.getloadavg(),
            "rounds": a.rounds, "codec_ms_median": float(np.median(codec)), "time": time.strftime("%Y-%m-%d %H:%M")}
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps({"meta": meta, "rows": [
        {k: v for k, v in r.items() if not k.startswith("_")} for r in rows]}, indent=1))
    md = ["| broker | bare MQTT ping-pong ms | kit round trip ms | draft compute ms | overhead ms (p50) | "
          "overhead p90 | samples |", "|---|---|---|---|---|---|---|"]
    md += [f"| {r['broker']} | {r['mqtt_ping_pong_ms']:.2f} | {r['kit_round_trip_ms']:.2f} | "
           f"{r['draft_compute_ms']:.2f} | {r['overhead_ms']:.2f} | {r['overhead_p90_ms']:.2f} | {r['samples']} |"
           for r in rows]
    md.append(f"\nencode + decode (HMAC both ways) of one request and one response: {meta['codec_ms_median']:.3f} ms "
              "median.\n\nOverhead = round trip - the draft's own compute_us; goal (issue 3): <= 1 ms median on "
              f"Mosquitto. Machine {meta['machine']}, {meta['cpus']} cpus, load average {meta['load_avg']}.")
    out.with_suffix(".md").write_text("\n".join(md) + "\n")
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4))
    for r in rows:
        ax.hist(r["_over"], bins=60, range=(0, 5), alpha=0.5, label=f"{r['broker']}: kit overhead")
        ax.hist(r["_floor"], bins=60, range=(0, 5), alpha=0.5, histtype="step", label=f"{r['broker']}: bare MQTT")
    ax.set_xlabel("ms")
    ax.set_ylabel("round trips")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out.with_suffix(".png"), dpi=100)
    print("\n".join(md))


if __name__ == "__main__":
    main()
