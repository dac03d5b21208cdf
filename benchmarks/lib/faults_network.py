"""Network faults for benchmarks/faults/faults.py: latency and jitter on a target's link (the delaying
proxy), packet loss (netem, where the kernel has it), pulled cables of a target, the draft service
and the hub (short and past MQTT's keepalive), a tampering middlebox, and the SUN workers' cables.

    sudo .venv/bin/python -m benchmarks.faults.faults --only partition
"""
from __future__ import annotations

import time
from typing import Callable

from benchmarks.lib.fault_bench import REQUEST_TIMEOUT, SUN_PROMPTS, Bench, Fault, Outcome


def _latency(profile: str) -> Callable[[Bench], Outcome]:
    def run(b: Bench) -> Outcome:
        line = b.star.set_delay(profile)
        try:
            rs = b.generate(("t1",))
        finally:
            b.star.set_delay("none")
        drafted = sum(len(b.star.monitor.answers("dev1", r["t0"], r["t1"])) for r in rs if "t0" in r)
        return b.score(rs, f"proxy {line} each way on dev1's link; {drafted} draft answers during its requests")
    return run


def _netem_loss(pct: int) -> Callable[[Bench], Outcome]:
    def run(b: Bench) -> Outcome:
        from harness.netns import netem_available
        if not netem_available():
            return Outcome("not run: this kernel has no netem qdisc (`tc qdisc ... netem` is unknown)")
        import subprocess
        dev = b.star.hosts["t1"]
        subprocess.run(dev.cmd("tc", "qdisc", "add", "dev", "star0", "root", "netem", "loss", f"{pct}%"), check=True)
        try:
            rs = b.generate(("t1",))
        finally:
            subprocess.run(dev.cmd("tc", "qdisc", "del", "dev", "star0", "root"), check=False)
        return b.score(rs, f"netem loss {pct}% on dev1's link")
    return run


def _partition(host: str, what: str, long: bool = False) -> Callable[[Bench], Outcome]:
    def run(b: Bench) -> Outcome:
        seconds = b.long_partition_s if long else b.partition_s
        load = ("t1", "t2")
        rs, healed = b.partition(host, seconds, load)
        affected = ["t1"] if host == "t1" else (["t2"] if host == "t2" else list(load))
        rec = b.recovery(affected, healed)
        return b.score(rs, f"{what}'s cable pulled for {seconds:g} s while dev1 and dev2 generate "
                           f"(decoding alone where cut off)", recovery_s=rec)
    return run


def _tamper(b: Bench) -> Outcome:
    """A middlebox flips one byte of dev1's TLS stream: TLS must refuse the record (the broker
    drops that connection; dev1 reconnects), so nothing tampered is ever accepted."""
    before = b.star.proxy_stats()
    b.star.proxy_stats(corrupt=True)
    t0 = time.monotonic()
    rs = b.generate(("t1",))
    after = b.star.proxy_stats()
    rec = b.recovery(["t1"], t0)
    reconnected = after["connections"] - before["connections"]
    # TLS refused the record iff the broker dropped that connection (dev1 then reconnects);
    # a connection that lived on would have carried the tampered bytes on: not known to be refused
    forged = 0 if reconnected > 0 else None
    return b.score(rs, f"1 byte flipped in {after['corrupted'] - before['corrupted']} chunk(s) of dev1's TLS "
                       f"stream; dev1 reconnected {reconnected} time(s)", forged_accepted=forged, recovery_s=rec)


def _sun_partition(host: str) -> Callable[[Bench], Outcome]:
    def run(b: Bench) -> Outcome:
        client, refs = b.sun
        star = b.star
        t0 = time.monotonic()
        with star.lab.partitioned(star.hosts[host]):
            hs = [client.submit("maths", p, max_new=24) for p in SUN_PROMPTS]
            time.sleep(b.partition_s)
        healed = time.monotonic()
        lost, done = 0, []
        for h, ref in zip(hs, refs):
            try:
                r = h.wait(REQUEST_TIMEOUT)
                lost += 0 if r.tokens == ref else len(ref)
                done.append(time.monotonic())
            except Exception:
                lost += len(ref)
        rec = (max(done) - healed) if len(done) == len(hs) else None
        return Outcome(f"{host}'s cable pulled for {b.partition_s:g} s with {len(hs)} SUN requests sent into it",
                       tokens=sum(map(len, refs)), tokens_lost=lost, recovery_s=rec,
                       max_request_s=(max(done) - t0) if done else REQUEST_TIMEOUT)
    return run


FAULTS = [
    Fault("latency LAN 1+-0.3 ms", "network", _latency("lan")),
    Fault("latency Wi-Fi 5+-3 ms", "network", _latency("wifi")),
    Fault("latency cellular 40+-15 ms", "network", _latency("cellular")),
    Fault("loss 1% (netem)", "network", _netem_loss(1)),
    Fault("loss 5% (netem)", "network", _netem_loss(5)),
    Fault("partition of a target (dev1)", "network", _partition("t1", "dev1")),
    Fault("partition of the draft service", "network", _partition("draft", "the draft service")),
    Fault("partition of the hub", "network", _partition("hub", "the hub")),
    Fault("long partition of a target (past keepalive)", "network", _partition("t1", "dev1", long=True)),
    Fault("tampering middlebox on dev1's link", "attack", _tamper),
    Fault("SUN: partition of the shared decoder", "network", _sun_partition("dec"), needs_sun=True),
    Fault("SUN: partition of the hub", "network", _sun_partition("hub"), needs_sun=True),
]
