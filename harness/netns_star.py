"""The star as real processes, each host in its own network namespace (harness/netns.py),
over TLS with the hub's ACL: the fixture of tests/system/test_star_namespaces.py and the
set-up of benchmarks/faults/faults.py.

    hub    edge-hub serve --mosquitto --acl --tls-dir certs --listen HUB:8883 (no draft of its own)
           + delay_proxy.py HUB:PROXY -> HUB:8883 (t1 connects through it: latency and jitter)
    draft  edge-agent run --role draft  (client id draft1)
    t1, t2 edge-agent run --role target (dev1 via the proxy, dev2 direct), OpenAI HTTP on :8000
    pre, dec  (sun=True) edge-agent run --role prefill / --role decoder (pre1, dec1)
    pre2, dec2  (sun=True) hosts, certificates and users for a second prefill worker and decoder,
           started by start_spares() (re-routing when pre1 or dec1 dies), stopped by stop_spares()

The test process (root namespace) reaches every host over its management link, never over the
switch: its monitor (role hub: sees every session's answers, which says when drafting works
again after a fault) and its HTTP requests keep working while a host's cable is pulled.
Control messages are signed with one --ctl-key-file. Models: harness/console_scripts.py's tiny float64
llama (greedy outputs compare exactly) and its SUN decoder + specialist.
"""
from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Dict, List, Optional

from harness.console_scripts import BIN, ROOT, Procs, hf_model as _hf_model, sun_dirs as _sun_dirs
from harness.hub_stats import sun_workers
from harness.namespace_star_base import HTTP_PORT, NamespaceStarBase
from harness.netns import NetLab
from harness.waiting import wait_until

DEVICES = {"t1": "dev1", "t2": "dev2"}


class Monitor:
    """The hub-role observer: when each session's draft answers (down) and requests (up) pass."""

    def __init__(self, url: str, tls) -> None:
        from edge.wire.link import MqttLink
        self.events: List[tuple] = []            # (monotonic time, client, draft service, "up"/"down")
        self._cv = threading.Condition()
        self.link = MqttLink(url, tls=tls, keepalive=5).connect(20)
        self.link.subscribe("ss/s/+/+/+/+", self._on)

    def _on(self, topic: str, payload: bytes) -> None:
        parts = topic.split("/")
        if len(parts) == 6:
            with self._cv:
                self.events.append((time.monotonic(), parts[2], parts[4], parts[5]))
                self._cv.notify_all()

    def answers(self, client: str, since: float = 0.0, until: float = float("inf")) -> List[tuple]:
        with self._cv:
            return [e for e in self.events if e[1] == client and e[3] == "down" and since <= e[0] < until]

    def wait_answer(self, client: str, since: float, timeout: float) -> Optional[float]:
        """Time of the first draft answer to `client` after `since`, waiting up to timeout."""
        end = time.monotonic() + timeout
        with self._cv:
            while True:
                got = [e[0] for e in self.events if e[1] == client and e[3] == "down" and e[0] >= since]
                if got:
                    return got[0]
                left = end - time.monotonic()
                if left <= 0:
                    return None
                self._cv.wait(left)

    def close(self) -> None:
        self.link.close()


class NamespaceStar(NamespaceStarBase):
    def __init__(self, root: Path, sun: bool = False, proxy_profile: str = "none", model: Optional[str] = None,
                 dtype: str = "float64", telemetry_s: float = 0.0) -> None:
        """model: a model name or path for the draft and both targets (default: the tiny llama).
        telemetry_s: the draft service and SUN workers publish telemetry this often (their dropped
        counts: what benchmarks/lib/faults_hostile.py reads); 0: off."""
        self.root, self.sun, self.proxy_profile = Path(root), sun, proxy_profile
        self.telemetry = ["--telemetry-interval", str(telemetry_s)] if telemetry_s else []
        self.model = model
        self.common = ["--threads", "1", "--dtype", dtype]
        self.lab: Optional[NetLab] = None
        self.ps = Procs(self.root)
        self.proxy: Optional[subprocess.Popen] = None
        self.monitor: Optional[Monitor] = None

    # ---- bring-up ----
    def _start(self) -> None:
        from server.broker import find_free_port
        self.lab = lab = NetLab()
        sun = ["pre", "dec", "pre2", "dec2"] if self.sun else []
        self.hosts = {n: lab.add(n) for n in ["hub", "draft", "t1", "t2"] + sun}
        hub = self.hosts["hub"]
        self.certs = self.root / "certs"
        names = ["dev1", "dev2", "draft1", "monitor", "app", "pre1", "dec1", "pre2", "dec2"]
        r = subprocess.run([BIN / "edge-hub", "certs", "--out", self.certs, "--host", hub.ip,
                            *[x for n in names for x in ("--client-id", n)]], capture_output=True, text=True)
        if r.returncode:
            raise RuntimeError(f"edge-hub certs failed: {r.stderr}")
        key = self.root / "ctl.key"
        key.write_bytes(os.urandom(24).hex().encode())
        self.ctl_key = key.read_bytes()
        signed = ["--ctl-key-file", key]
        self.tls_port, self.proxy_port = find_free_port(), find_free_port()   # free here: pid files are per port
        self.url = f"mqtts://{hub.ip}:{self.tls_port}"
        users = ["dev1", "dev2", "draft1:draft", "monitor:hub", "app", "pre1:sun", "dec1:sun", "pre2:sun", "dec2:sun"]
        self.ps.start("hub", *hub.cmd(BIN / "edge-hub", "serve", "--mosquitto", "--acl", "--port", find_free_port(),
                                      "--tls-dir", self.certs, "--listen", f"{hub.ip}:{self.tls_port}",
                                      "--stats-every", "0.5", *signed, *self.common,
                                      *[x for u in users for x in ("--user", u)],
                                      "--credentials-out", self.root / "hub-users.txt"))
        err = open(self.root / "proxy.err", "wb")
        self.proxy = subprocess.Popen(hub.cmd(sys.executable, "-m", "harness.delay_proxy", "--listen",
                                              f"{hub.ip}:{self.proxy_port}", "--to", f"{hub.ip}:{self.tls_port}",
                                              "--profile", self.proxy_profile),
                                      stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=err, cwd=ROOT)
        err.close()
        self.model = self.model or _hf_model(self.root / "tiny-hf")     # while the hub starts
        if self.sun:
            self.dec_dir, self.maths_dir = _sun_dirs(self.root)
        self.ps.wait_for("hub", f"devices: {self.url}", timeout=90)
        agent = [BIN / "edge-agent", "run", "--tls-dir", self.certs]
        self.signed = signed
        self.ps.start("draft", *self.hosts["draft"].cmd(*agent, "--broker", self.url, "--role", "draft",
                                                         "--client-id", "draft1", "--model", self.model,
                                                         *signed, *self.common, *self.telemetry))
        if self.sun:
            self._start_sun("pre", "dec", "1")
        for name, dev in DEVICES.items():
            url = self.url if name == "t2" else f"mqtts://{hub.ip}:{self.proxy_port}"
            self.ps.start(name, *self.hosts[name].cmd(*agent, "--broker", url, "--role", "target", "--client-id",
                                                       dev, "--model", self.model, "--http-host",
                                                       self.hosts[name].ip, "--http-port", HTTP_PORT, "-g", "3",
                                                       *self.common))
        self.monitor = Monitor(self.url, self.tls("monitor"))
        self.ps.wait_for("draft", "registered at", timeout=120)
        for name in DEVICES:
            self.ps.wait_for(name, "OpenAI endpoint on", timeout=120)
        for name in (["pre", "dec"] if self.sun else []):
            self.ps.wait_for(name, "up at", timeout=120)
        if self.sun:
            self.wait_routed(2)
        for name in DEVICES:          # up: each target drafted for (it may have started before the draft)
            if self.recovery(name, "the", 8, since=0.0, timeout=60) is None:
                raise RuntimeError(f"{name} was never drafted for:\n{self.ps.err(name)}\n{self.ps.err('draft')}")

    def _start_sun(self, pre: str, dec: str, n: str) -> None:
        agent = [BIN / "edge-agent", "run", "--tls-dir", self.certs, "--broker", self.url, "--threads", "1",
                 *self.signed, *self.telemetry]
        self.ps.start(pre, *self.hosts[pre].cmd(*agent, "--role", "prefill", "--client-id", f"pre{n}",
                                                "--module", self.maths_dir, "--task", "maths"))
        self.ps.start(dec, *self.hosts[dec].cmd(*agent, "--role", "decoder", "--client-id", f"dec{n}",
                                                "--module", self.dec_dir, "--max-batch", "8"))

    def start_spares(self, timeout: float = 120.0) -> None:
        """Start the second prefill worker (pre2) and decoder (dec2); returns once both are up
        (the router routes to them once they answered its probe: a hello or two later)."""
        self._start_sun("pre2", "dec2", "2")
        for name in ("pre2", "dec2"):
            self.ps.wait_for(name, "up at", timeout=timeout)

    def wait_routed(self, workers: int, timeout: float = 120.0) -> None:
        """Return once a stats line of the hub, written after this call, says its SUN router routes
        to `workers` workers (harness/hub_stats.py); the timeout is a hang guard."""
        start = len(self.ps.err("hub"))
        if not wait_until(lambda: sun_workers(self.ps.err("hub")[start:]) == workers, timeout):
            raise RuntimeError(f"the hub's router never routed to {workers} SUN workers:\n{self.ps.err('hub')[-3000:]}")

    def stop_spares(self) -> None:
        """Stop pre2 and dec2 cleanly (their offline hellos take them off the router)."""
        for name in ("pre2", "dec2"):
            if name in self.ps.procs:
                self.ps.stop(name)

    def tls(self, name: str) -> tuple:
        c = self.certs
        return str(c / "ca.crt"), str(c / "clients" / f"{name}.crt"), str(c / "clients" / f"{name}.key")

    # ---- use ----
    def set_delay(self, spec: str, timeout: float = 10.0) -> str:
        """Change the proxy's delay (a profile name or 'MEAN JITTER' ms) and wait until it applies."""
        return self._proxy_say(spec, "delay ", timeout)

    def proxy_stats(self, corrupt: bool = False) -> Dict[str, int]:
        """The proxy's counters (connections, bytes, corrupted); corrupt=True first arms it to
        flip one byte of dev1's next chunk to the broker."""
        line = self._proxy_say("corrupt" if corrupt else "stats", "stats ")
        return {k: int(v) for k, v in (kv.split("=") for kv in line.split()[1:])}

    def _proxy_say(self, line: str, answer: str, timeout: float = 10.0) -> str:
        path = self.root / "proxy.err"
        before = path.read_text().count(answer)
        self.proxy.stdin.write((line + "\n").encode())
        self.proxy.stdin.flush()
        end = time.monotonic() + timeout
        while path.read_text().count(answer) == before:
            if "error:" in path.read_text() or time.monotonic() > end:
                raise RuntimeError(f"the delay proxy did not take {line!r}:\n{path.read_text()}")
            time.sleep(0.02)
        return [x for x in path.read_text().splitlines() if x.startswith(answer)][-1]

    def recovery(self, host: str, prompt: str, max_new: int, since: float, timeout: float = 60.0) -> Optional[float]:
        """Seconds from `since` (the fault's end) until `host`'s session is drafted for again,
        generating on it meanwhile (a session is only drafted for while it decodes); None past timeout."""
        client = DEVICES[host]
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            t = self.monitor.answers(client, since)
            if t:
                return t[0][0] - since
            self.complete(host, prompt, max_new, timeout=max(1.0, end - time.monotonic()))
        t = self.monitor.answers(client, since)
        return t[0][0] - since if t else None

    def pids(self) -> Dict[str, int]:
        """The pid of each live process of the star, the hub's Mosquitto child as 'mosquitto'."""
        pids = {n: p.pid for n, p in self.ps.procs.items() if p.poll() is None}
        for pid in list(pids.values()):
            try:
                kids = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
            except OSError:
                kids = []
            for k in kids:
                if Path(f"/proc/{k}/comm").read_text().strip() == "mosquitto":
                    pids["mosquitto"] = int(k)
        return pids

    def status_mb(self, field: str = "VmHWM") -> Dict[str, float]:
        """A /proc/PID/status memory field (VmHWM: peak, VmRSS: now) of each live process, MiB."""
        out = {}
        for n, pid in self.pids().items():
            try:
                for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                    if line.startswith(field + ":"):
                        out[n] = int(line.split()[1]) / 1024
            except OSError:
                pass
        return out

    def peak_rss_mb(self) -> Dict[str, float]:
        """VmHWM of each live process of the star (MiB), Mosquitto included."""
        return self.status_mb("VmHWM")

    def close(self) -> None:
        if self.monitor is not None:
            self.monitor.close()
        self.ps.close()
        if self.proxy is not None and self.proxy.poll() is None:
            self.proxy.kill()
            self.proxy.wait()
        if self.lab is not None:
            self.lab.close()
