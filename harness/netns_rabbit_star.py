"""The StarSD star on a 3-node RabbitMQ cluster whose nodes and clients each live on a host of
their own (harness/netns.py + harness/netns_rabbitmq.py): real processes, TLS certificate login,
per-user topic permissions, two hubs. tests/system/test_cluster_partition.py's set-up.

    r1 r2 r3   RabbitMQ nodes (pause_minority), MQTT over TLS on 8883
    ha, hb     edge-hub serve --broker <list> --tls-dir certs --hub-id ha|hb --hub-ids ha,hb
    draft      edge-agent run --role draft (draft1)
    t1, t2     edge-agent run --role target --hub-ids ha,hb (OpenAI HTTP on :8000); t1's client id
               is owned by ha, t2's by hb (rendezvous hashing, edge/star/hub_ring.py)

Each client gets the whole node list, starting on its own node (ATTACH): ha and t1 on r3 (the
node a test cuts), hb and t2 on r1, the draft service on r2. The test process (root namespace)
watches over the management links, which a cut leaves up: an `Observer` (hub role, on r2 then
r1) sees every session's draft answers and every hub's and the draft service's announcements.
Model: harness/console_scripts.py's tiny float64 llama (greedy outputs compare exactly).
"""
from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Dict, List, Optional

from edge.star.hub_ring import owner
from edge.wire.link import MqttLink
from edge.wire.protocol import (DraftHello, HubStatus, Joined, ProtocolError, SessionAssign, SessionRelease, decode,
                                draft_ctl_topic, draft_hello_topic, hub_hello_topic, subscription)
from harness.namespace_star_base import HTTP_PORT, NamespaceStarBase
from harness.netns import NetLab
from harness.netns_rabbitmq import NetnsRabbitCluster
from harness.star_processes import BIN, Procs, hf_model

HUBS = ("ha", "hb")
DRAFT = "draft1"
ATTACH = {"ha": (2, 0, 1), "hb": (0, 1, 2), "draft": (1, 2, 0), "t1": (2, 0, 1), "t2": (0, 1, 2)}
EVICT_S = 20.0       # the draft service's eviction of silent sessions (default 60): the backstop for a
                     # bye lost in a dead TCP connection, short enough to see the drain in the test


def client_of(hub: str) -> str:
    """A device name whose owner, while both hubs live, is `hub`."""
    return next(c for c in (f"dev{i}" for i in range(1, 200)) if owner(c, HUBS) == hub)


class Observer:
    """Draft answers per client, the hubs' and the draft service's last announcements."""

    def __init__(self, urls: str, tls) -> None:
        self.answers_: List[tuple] = []        # (monotonic time, client, service)
        self.last: Dict[str, object] = {}
        self.assigned: Dict[str, tuple] = {}     # sid -> (time, client): a hub's SessionAssign
        self.released: Dict[str, tuple] = {}     # sid -> (time, reason): the service's SessionRelease
        self.lock = threading.Lock()
        self.link = MqttLink(urls, tls=tls, keepalive=5, reconnect_delay=(0.05, 0.5)).connect(20)
        self.link.subscribe("ss/s/+/+/+/down", self._on_answer)
        self.joins: List[tuple] = []             # (monotonic time, client, sid): a hub accepted a join
        self.link.subscribe(subscription("joined"), self._on_joined)
        for topic in [hub_hello_topic(h) for h in HUBS] + [draft_hello_topic(DRAFT)]:
            self.link.subscribe(topic, self._on_hello)
        self.link.subscribe(draft_ctl_topic(DRAFT), self._on_hello)

    def _on_answer(self, topic: str, payload: bytes) -> None:
        parts = topic.split("/")
        with self.lock:
            self.answers_.append((time.monotonic(), parts[2], parts[4]))

    def _on_joined(self, topic: str, payload: bytes) -> None:
        try:
            msg = decode(payload)
        except ProtocolError:
            return
        if isinstance(msg, Joined) and msg.accepted:
            with self.lock:
                self.joins.append((time.monotonic(), msg.client, msg.sid))

    def joined(self, client: str, since: float = 0.0) -> List[float]:
        """When hubs accepted `client`'s joins (at or after `since`)."""
        with self.lock:
            return [t for t, c, _ in self.joins if c == client and t >= since]

    def _on_hello(self, topic: str, payload: bytes) -> None:
        msg = decode(payload) if payload else None
        with self.lock:
            now = time.monotonic()
            if isinstance(msg, (HubStatus, DraftHello)):
                self.last[getattr(msg, "hub", None) or msg.service] = (now, msg)
            elif isinstance(msg, SessionAssign):
                self.assigned[msg.sid] = (now, msg.client)
            elif isinstance(msg, SessionRelease) and topic == draft_hello_topic(DRAFT):
                self.released[msg.sid] = (now, msg.reason)

    def unreleased(self) -> Dict[str, tuple]:
        """Sessions a hub assigned that the draft service never released: sid -> (time, client)."""
        with self.lock:
            return {sid: v for sid, v in self.assigned.items() if sid not in self.released}

    def answers(self, client: str, since: float = 0.0, until: float = float("inf")) -> List[float]:
        with self.lock:
            return [t for t, c, _ in self.answers_ if c == client and since <= t < until]

    def hello(self, name: str, fresh_s: float = 5.0):
        """`name`'s last announcement if at most fresh_s old, else None."""
        with self.lock:
            t, msg = self.last.get(name, (0.0, None))
        return msg if time.monotonic() - t <= fresh_s else None

    def hub_live(self, hub: str) -> bool:
        st = self.hello(hub)
        return isinstance(st, HubStatus) and st.online

    def sessions(self) -> Dict[str, int]:
        """Sessions each hub and the draft service hold now (-1: no fresh announcement)."""
        return {n: getattr(self.hello(n), "sessions", -1) for n in (*HUBS, DRAFT)}

    def close(self) -> None:
        self.link.close()


class RabbitNamespaceStar(NamespaceStarBase):
    def __init__(self, root: Path, keepalive: Optional[int] = None) -> None:
        """keepalive: --keepalive of every hub and agent (None: their default)."""
        self.root = Path(root)
        self.link_opts = [] if keepalive is None else ["--keepalive", keepalive]
        self.ps = Procs(self.root)
        self.lab: Optional[NetLab] = None
        self.cluster: Optional[NetnsRabbitCluster] = None
        self.observer: Optional[Observer] = None
        self.devices = {"t1": client_of("ha"), "t2": client_of("hb")}

    def _start(self) -> None:
        self.lab = NetLab()
        self.cluster = c = NetnsRabbitCluster(lab=self.lab, tls=True)
        devs = list(self.devices.values())
        c.start(clients=[*HUBS, DRAFT, *devs, "monitor"])
        c.add_users({**{h: "hub" for h in HUBS}, DRAFT: "draft", **{d: "client" for d in devs}, "monitor": "hub"})
        self.hosts = {n: self.lab.add(n) for n in ATTACH}
        self.model = hf_model(self.root / "tiny-hf")
        common = ["--threads", "1", "--dtype", "float64"]
        for h in HUBS:
            self.start_hub(h)
        self.ps.start("draft", *self._agent("draft", "--role", "draft", "--client-id", DRAFT, "--model",
                                            self.model, "--evict-after", EVICT_S, *common))
        for t, dev in self.devices.items():
            self.ps.start(t, *self._agent(t, "--role", "target", "--client-id", dev, "--hub-ids", ",".join(HUBS),
                                          "--model", self.model, "--http-host", self.hosts[t].ip,
                                          "--http-port", HTTP_PORT, "-g", "3", *common))
        self.observer = Observer(c.urls(1, 0), c.tls_files("monitor"))
        ob = self.observer
        for h in HUBS:                     # each hub up, and its probe proved the draft service alive
            self._until(lambda: ob.hub_live(h) and DRAFT in ob.hello(h).services, 120, h)
        for t in self.devices:
            self.ps.wait_for(t, "OpenAI endpoint on", timeout=120)

    def urls(self, host: str) -> str:
        return self.cluster.urls(*ATTACH[host])

    def start_hub(self, h: str) -> None:
        self.ps.start(h, *self.hosts[h].cmd(BIN / "edge-hub", "-v", "serve", "--broker", self.urls(h), "--tls-dir",
                                            self.cluster.certs, "--hub-id", h, "--hub-ids", ",".join(HUBS),
                                            "--stats-every", "0", *self.link_opts))

    def _agent(self, host: str, *args) -> list:
        return self.hosts[host].cmd(BIN / "edge-agent", "run", "-v", "--broker", self.urls(host), "--tls-dir",
                                    self.cluster.certs, *self.link_opts, *args)

    def _until(self, cond, timeout: float, name: str) -> None:
        end = time.monotonic() + timeout
        while not cond():
            if time.monotonic() > end or self.ps.procs[name].poll() is not None:
                raise RuntimeError(f"{name} did not come up:\n{self.ps.err(name)[-3000:]}")
            time.sleep(0.1)

    # ---- use ----
    def close(self) -> None:
        if self.observer is not None:
            self.observer.close()
        self.ps.close()
        if self.cluster is not None:
            self.cluster.close()
        if self.lab is not None:
            self.lab.close()
