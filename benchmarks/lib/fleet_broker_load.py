"""How many round-shaped messages one broker node carries: emulated targets and draft echoes.

Each emulated target is its own paho client: it publishes a request of the measured size on its
session's `up` topic (ss/s/{client}/{sid}/{service}/up, QoS as the star: KINDS["draft"]) and, on
each answer on its `down` topic, the next one, with `window` requests in flight. The "draft
services" are paho clients that answer every request at once with a response of the measured
size on the session's `down` topic. So the broker sees exactly the star's round traffic (two
publishes per round, each delivered to one subscriber) with none of the model's time.

Targets and echoes run in their own processes (fork), so their Python is not the broker's
bottleneck before it must be; on a 2-core machine they still are, so the broker's own CPU
seconds over the window are read from /proc and reported beside the messages: messages per
broker CPU second is what one core of broker would carry if the clients were free.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import socket
import time
from typing import Optional

import paho.mqtt.client as mqtt

from edge.wire.link import KINDS, parse_url

QOS = KINDS["draft"][0]
CLK_TCK = os.sysconf("SC_CLK_TCK")


def proc_cpu_s(pid: int) -> float:
    """utime + stime of a process, seconds."""
    with open(f"/proc/{pid}/stat") as f:
        parts = f.read().rsplit(")", 1)[1].split()
    return (int(parts[11]) + int(parts[12])) / CLK_TCK


def _client(url: str, cid: str) -> mqtt.Client:
    host, port, _, _ = parse_url(url)
    c = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=cid)
    c.max_inflight_messages_set(0)
    c.max_queued_messages_set(0)

    def nodelay(client, userdata, sock):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    c.on_socket_open = nodelay
    c.connect(host, port, keepalive=60)
    return c


def _topics(i: int, services: int) -> tuple:
    base = f"ss/s/dev{i:05d}/{i:016x}/svc{i % services}"
    return f"{base}/up", f"{base}/down"


def _echo_main(url: str, j: int, resp: bytes, ready, stop) -> None:
    c = _client(url, f"echo{j}-{os.getpid()}")

    def on_message(client, userdata, msg):
        client.publish(msg.topic[:-2] + "down", resp, qos=QOS)
    c.on_message = on_message
    c.subscribe(f"ss/s/+/+/svc{j}/up", qos=QOS)
    c.loop_start()
    time.sleep(0.5)
    ready.set()
    stop.wait()
    c.disconnect()
    c.loop_stop()


def _targets_main(url: str, ids: list, services: int, req: bytes, window: int, ready, go, stop, out) -> None:
    counts = {"rounds": 0, "in_window": 0, "t_open": None}
    clients = []
    for i in ids:
        up, down = _topics(i, services)
        c = _client(url, f"t{i}-{os.getpid()}")

        def on_message(client, userdata, msg, up=up):
            counts["rounds"] += 1
            client.publish(up, req, qos=QOS)
        c.on_message = on_message
        c.subscribe(down, qos=QOS)
        c.loop_start()
        clients.append((c, up))
    time.sleep(1.0)                      # subscriptions settle
    ready.set()
    go.wait()
    for c, up in clients:
        for _ in range(window):
            c.publish(up, req, qos=QOS)
    time.sleep(1.0)                      # warm-up
    r0, t0 = counts["rounds"], time.monotonic()
    stop.wait()
    out.put({"rounds": counts["rounds"] - r0, "seconds": time.monotonic() - t0})
    for c, _ in clients:
        c.disconnect()
        c.loop_stop()


def run_load(url: str, broker_pid: Optional[int], targets: int, services: int, req_bytes: int,
             resp_bytes: int, window: int = 2, seconds: float = 8.0, target_procs: int = 2) -> dict:
    """One point: `targets` emulated targets over `services` echo services for `seconds`."""
    ctx = mp.get_context("fork")
    stop, go, out = ctx.Event(), ctx.Event(), ctx.Queue()
    procs, readies = [], []
    for j in range(services):
        ev = ctx.Event()
        procs.append(ctx.Process(target=_echo_main, args=(url, j, b"d" * resp_bytes, ev, stop), daemon=True))
        readies.append(ev)
    for p in range(target_procs):
        ids = list(range(p, targets, target_procs))
        ev = ctx.Event()
        procs.append(ctx.Process(target=_targets_main, daemon=True,
                                 args=(url, ids, services, b"r" * req_bytes, window, ev, go, stop, out)))
        readies.append(ev)
    for p in procs:
        p.start()
    try:
        for ev in readies:
            if not ev.wait(60):
                raise RuntimeError("an emulated client did not connect in 60 s")
        go.set()
        time.sleep(1.0)
        cpu0, t0 = (proc_cpu_s(broker_pid) if broker_pid else 0.0), time.monotonic()
        time.sleep(seconds)
        cpu1, t1 = (proc_cpu_s(broker_pid) if broker_pid else 0.0), time.monotonic()
        stop.set()
        parts = [out.get(timeout=30) for _ in range(target_procs)]
    finally:
        stop.set()
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
    rounds = sum(x["rounds"] for x in parts)
    secs = max(x["seconds"] for x in parts)
    routed = 2 * rounds / secs                      # publishes in per second (each delivered once)
    cpu = (cpu1 - cpu0) / (t1 - t0) if broker_pid else None
    return {"targets": targets, "services": services, "window": window, "req_bytes": req_bytes,
            "resp_bytes": resp_bytes, "seconds": secs, "rounds_per_s": rounds / secs, "routed_msgs_per_s": routed,
            "broker_cpu_share": cpu,
            "routed_msgs_per_broker_cpu_s": routed / cpu if cpu else None,
            "payload_mb_per_s": rounds / secs * (req_bytes + resp_bytes) / 1e6}
