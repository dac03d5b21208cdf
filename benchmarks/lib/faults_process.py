"""Process faults for benchmarks/faults/faults.py: kill -9 of a star process while it works, then start it again.

Each fault SIGKILLs one process of the namespace star (the hub, its Mosquitto, the draft
service, a target, the SUN decoder, the SUN prefill worker), starts it again with the same
command (as systemd would), and reports what the clients saw (tokens lost, the slowest
request), how long the star took to notice (the will's offline hello, as a hub-role observer
sees it: `extra.noticed_s`) and how long it took to draft for / serve the clients again once
the process was back (recovery). `tests/system/test_process_faults.py` proves the same faults
leak nothing (it can look inside the hub); this measures them on the star across namespaces.
The SUN rows run with a second prefill worker and decoder (the star's pre2, dec2) so that the
requests of the killed one are re-routed (prefilled again, as their KV died with it); their
recovery is from the kill until those requests were served.

    sudo .venv/bin/python -m benchmarks.faults.faults --only kill
"""
from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path
from typing import List, Optional

from benchmarks.lib.fault_bench import REQUEST_TIMEOUT, SUN_PROMPTS, Fault, Outcome

WORKERS = {"draft": "ss/hub/drafts/draft1", "dec": "ss/sun/workers/dec1", "pre": "ss/sun/workers/pre1",
           "dec2": "ss/sun/workers/dec2", "pre2": "ss/sun/workers/pre2"}


class Hellos:
    """When each retained hello (drafts, SUN workers, the hub's status) said online or offline."""

    def __init__(self, star) -> None:
        from edge.wire.link import MqttLink
        self.key, self.events, self._lock = star.ctl_key, [], threading.Lock()
        self.link = MqttLink(star.url, tls=star.tls("monitor"), keepalive=5).connect(20)
        for pattern in ("ss/hub/drafts/+", "ss/sun/workers/+", "ss/hub/status"):
            self.link.subscribe(pattern, self._on)

    def _on(self, topic: str, payload: bytes) -> None:
        from edge.wire.protocol import ProtocolError, decode
        try:
            online = getattr(decode(payload, self.key), "online", None)
        except ProtocolError:
            return                                        # a SessionRelease, or an empty retained clear
        if online is not None:
            with self._lock:
                self.events.append((time.monotonic(), topic, online))

    def first(self, topic: str, online: bool, since: float, timeout: float = 30.0) -> Optional[float]:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            with self._lock:
                got = [t for t, tp, on in self.events if tp == topic and on is online and t >= since]
            if got:
                return got[0] - since
            time.sleep(0.02)
        return None

    def count(self, topic: str, online: bool, n: int, since: float, timeout: float = 30.0) -> int:
        """Wait until `n` such hellos came after `since`; how many did."""
        end = time.monotonic() + timeout
        while True:
            with self._lock:
                got = sum(1 for t, tp, on in self.events if tp == topic and on is online and t >= since)
            if got >= n or time.monotonic() > end:
                return got
            time.sleep(0.05)

    def close(self) -> None:
        self.link.close()


def _restart(star, name: str) -> float:
    """Start `name` again with the command it had; returns when it was started."""
    star.ps.start(name, *star.ps.procs[name].args)
    return time.monotonic()


def _kill(star, name: str) -> float:
    """SIGKILL `name`; returns when the signal was sent (the broker may publish its will before
    the process is reaped)."""
    p = star.ps.procs[name]
    t = time.monotonic()
    p.kill()
    p.wait(10)
    return t


def _mosquitto_pid(star) -> int:
    hub = star.ps.procs["hub"].pid
    for k in Path(f"/proc/{hub}/task/{hub}/children").read_text().split():
        if Path(f"/proc/{k}/comm").read_text().strip() == "mosquitto":
            return int(k)
    raise RuntimeError("the hub runs no Mosquitto child")


def _during(b, hosts, fault, n: int = 3) -> List[dict]:
    """`n` requests on each of `hosts` with `fault()` run 0.3 s into the first."""
    out: List[dict] = []
    t = threading.Thread(target=lambda: out.extend(b.generate(hosts, n=n)))
    t.start()
    time.sleep(0.3)
    fault()
    t.join()
    return out


def _starsd(name: str, what: str, topic: Optional[str], wait_text: str, load=("t1", "t2")):
    def run(b) -> Outcome:
        star, hellos = b.star, Hellos(b.star)
        try:
            times = {}

            def fault():
                times["kill"] = _kill(star, name)
                times["back"] = _restart(star, name)
            rs = _during(b, load, fault)
            star.ps.wait_for(name, wait_text, timeout=120)
            noticed = hellos.first(topic, False, times["kill"]) if topic else None
            rec = b.recovery(list(load), times["back"])
            rs += b.generate(load, n=1)                   # after it: the no-fault text again
            return b.score(rs, f"{what} killed 0.3 s into a request on {', '.join(load)}, started again "
                               f"at once; recovery counted from its restart (it loads its model)",
                           focus=load[0], recovery_s=rec,
                           extra={"noticed_s": noticed, "ready_s": time.monotonic() - times["back"]})
        finally:
            hellos.close()
    return run


def _target(b) -> Outcome:
    """dev1 dies mid-request (its own request dies with it); dev2 keeps its text; dev1 rejoins."""
    star = b.star
    rs, times = [], {}

    def fault():
        times["kill"] = _kill(star, "t1")
        times["back"] = _restart(star, "t1")
    t1 = threading.Thread(target=lambda: b.generate(("t1",), n=3))   # the victim's own requests: dropped
    t1.start()
    rs = _during(b, ("t2",), fault)
    t1.join()
    star.ps.wait_for("t1", "OpenAI endpoint on", timeout=120)
    rec = b.recovery(["t1"], times["back"])
    rs += b.generate(("t1", "t2"), n=1)
    return b.score(rs, "dev1's target process killed mid-request (its own request dies with it, not "
                       "counted) while dev2 generates; dev1 started again", focus="t2", recovery_s=rec)


def _hub_mosquitto(b) -> Outcome:
    """The hub's own Mosquitto killed: the hub starts it again (its status loop, every 2 s)."""
    star, times = b.star, {}

    def fault():
        os.kill(_mosquitto_pid(star), signal.SIGKILL)
        times["kill"] = time.monotonic()
    rs = _during(b, ("t1", "t2"), fault)
    rec = b.recovery(["t1", "t2"], times["kill"])
    rs += b.generate(("t1", "t2"), n=1)
    return b.score(rs, "the hub's Mosquitto child killed mid-request; the hub starts it again on its port",
                   recovery_s=rec)


def _sun(name: str, what: str) -> callable:
    """kill -9 of SUN worker `name` holding requests, a second prefill worker and decoder up
    (pre2, dec2): the router fails the requests at once (worker_lost), the client sends them
    again under new ids (prefilled again: the KV died with the worker) and the live pair serves
    them, with no token lost, changed or repeated; then the killed one is started again and,
    once the spares are stopped, serves again."""
    def run(b) -> Outcome:
        from harness.console_scripts import sun_reference as _sun_reference
        star, (client, refs) = b.star, b.sun
        hellos = Hellos(star)
        star.start_spares()
        try:
            for w in ("pre2", "dec2"):                    # proven alive by the router: its probe answered
                hellos.count(WORKERS[w], True, 3, since=0.0)
            told, frozen = [], threading.Event()
            victim = star.ps.procs[name].pid
            if name == "pre":
                os.kill(victim, signal.SIGSTOP)           # it takes jobs, answers nothing
                prompts, max_new = SUN_PROMPTS, 24
                wanted = refs
                hs = [client.submit("maths", p, max_new=max_new) for p in prompts]
                time.sleep(0.5)                           # the jobs reach the frozen worker
            else:
                # long enough to be frozen mid-stream: SIGSTOP on the third token, from the callback
                max_new = 400
                wanted = [_sun_reference(star.maths_dir, star.dec_dir, SUN_PROMPTS[0], max_new)]

                def on_token(i, t):
                    told.append((i, t))
                    if i == 2 and not frozen.is_set():
                        os.kill(victim, signal.SIGSTOP)
                        frozen.set()
                hs = [client.submit("maths", SUN_PROMPTS[0], max_new=max_new, on_token=on_token)]
                frozen.wait(REQUEST_TIMEOUT)
            t0 = time.monotonic()
            killed = _kill(star, name)
            lost, errors, done, served, resent = 0, [], [], [], 0
            for h, ref in zip(hs, wanted):
                try:
                    r = h.wait(REQUEST_TIMEOUT)
                    lost += 0 if r.tokens == ref else len(ref)
                    done.append(time.monotonic())
                    served.append("+".join(r.workers))
                except Exception as e:  # failed or timed out: lost
                    lost += len(ref)
                    errors.append(f"{type(e).__name__}: {e}"[:120])
                resent += h.resent
            if told and told != list(enumerate(wanted[0][:len(told)])):
                lost = len(wanted[0])                     # a token handed out twice or changed
            noticed = hellos.first(WORKERS[name], False, killed)
            back = _restart(star, name)
            star.ps.wait_for(name, "up at", timeout=120)
            star.stop_spares()
            rejoined = None
            end = time.monotonic() + 90
            while rejoined is None and time.monotonic() < end:
                try:
                    r = client.generate("maths", SUN_PROMPTS[0], max_new=24, timeout=REQUEST_TIMEOUT)
                    rejoined = time.monotonic() - back if r.tokens == refs[0] else None
                except Exception:
                    time.sleep(0.2)                       # not routed to yet: it is proving it is alive
            return Outcome(f"{what}, a second prefill worker and decoder up: the router failed its requests "
                           f"at once (worker_lost) and the client sent them again ({resent} resent), served by "
                           f"{', '.join(served) or 'none'}{'; errors: ' + '; '.join(errors) if errors else ''}; "
                           f"started again, it served again {rejoined and round(rejoined, 1)} s after its restart",
                           tokens=sum(map(len, wanted)), tokens_lost=lost,
                           recovery_s=(max(done) - killed) if len(done) == len(hs) else None,
                           max_request_s=(max(done) - t0) if done else REQUEST_TIMEOUT,
                           extra={"noticed_s": noticed, "resent": resent, "served_by": served,
                                  "rejoined_s": rejoined})
        finally:
            star.stop_spares()
            hellos.close()
    return run


FAULTS = [
    Fault("kill -9 of the draft service", "process",
          _starsd("draft", "the draft service (edge-agent run --role draft)", WORKERS["draft"], "registered at")),
    Fault("kill -9 of a target (dev1)", "process", _target),
    Fault("kill -9 of the hub (edge-hub serve --mosquitto)", "process",
          _starsd("hub", "the hub and its Mosquitto", None, "devices: ")),
    Fault("kill -9 of the hub's Mosquitto", "process", _hub_mosquitto),
    Fault("SUN: kill -9 of the shared decoder mid-stream", "process",
          _sun("dec", "the shared decoder (dec1) frozen on its third token and killed"), needs_sun=True),
    Fault("SUN: kill -9 of the prefill worker holding jobs", "process",
          _sun("pre", "the prefill worker (pre1) frozen (SIGSTOP) with 2 jobs, then killed"), needs_sun=True),
]
