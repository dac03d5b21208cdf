"""The hub daemon: broker (embedded or external), registry, its own draft service, SUN routing.

Topics and messages are edge/wire/protocol.py's. The hub answers joins on
ss/hub/join/{client}, keeps a retained HubStatus on ss/hub/status stamped
with its start time (its *epoch*: targets that see a new epoch, or the last
will's online=False, know their sessions are gone and rejoin), watches draft
services' DraftHello on ss/hub/drafts/+ and assigns sessions to its own
service directly or to remote ones with SessionAssign.

With several hubs (`hubs`: every hub's id, its own included) it announces itself on its own
ss/hubs/{hub_id} instead (retained, its will says offline), watches the others' there and answers
only the joins that name it, and those that name no hub when it is their owner (server/hub_peers.py).
Draft services and SUN workers serve every hub: their hellos are read by all, and a service's own
session count in its hello is the shared truth of its slots.

It also routes SUN requests (server/sun_router.py: task -> its prefill
worker, KV -> the least-loaded shared decoder, or per-task pools when
isolated) and may host a shared decoder itself (`sun_decoder`), which then
announces itself like any device's decoder, on the hub's own link.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Optional

from edge.wire.link import Link, MqttLink
from edge.wire.protocol import (DRAFTS_SUB, JOIN_SUB, STATUS_TOPIC, DraftHello, HubStatus, Join, Joined, Probe,
                           ProtocolError, SessionAssign, SessionRelease, decode, down_topic,
                           draft_ctl_topic, draft_hello_topic, encode, hub_hello_topic, joined_topic,
                           parse_topic, sun_hello_topic, up_topic)
from edge.star.hub_ring import HUB_SILENT_S
from edge.star.draft_kinds import make_draft_core
from edge.star.draft_limits import DraftRefused
from edge.star.draft_service import DraftLimits, DraftService
from edge.star.draft_node import DraftNode
from edge.wire.seen_ids import SeenIds
from server.discovery import Discovery
from server.hub_peers import HubPeers
from server.hub_verify import VerifySide, answer_drafter
from server.join_ended import release_ended
from server.registry import CLIENT_SHARE, Refusal, Registry
from server.sun_router import SunRouter

log = logging.getLogger(__name__)


class Hub:
    """Start with `start()`; `stop()` leaves cleanly, `kill()` dies like a killed process."""

    def __init__(self, *, broker_url: Optional[str] = None, broker: str = "embedded",
                 port: Optional[int] = None, acl: bool = False, link: Optional[Link] = None,
                 draft_engine=None, tokenizer_fp: str = "", limits: Optional[DraftLimits] = None,
                 draft_core=None,
                 hub_id: str = "hub", username: Optional[str] = None, password: Optional[str] = None,
                 status_every: float = 2.0, ctl_key: Optional[bytes] = None, sun: bool = True,
                 sun_isolated: bool = False, sun_pools: Optional[dict] = None, sun_decoder=None,
                 listeners=(), client_share: float = CLIENT_SHARE, hubs=(), hub_silent_s: float = HUB_SILENT_S,
                 keepalive: int = 15, verify_engine=None, verify_fp: str = "", verify_limits=None,
                 verify_grammars=None):
        """hubs: the ids of every hub of the star, this one's included (several hubs); empty: this
        hub is the only one, as before. sun: route SUN requests; sun_isolated / sun_pools: one decoder pool per task
        ({task: [decoder ids]}); sun_decoder: a SharedDecoder the hub serves as
        f"{hub_id}-decoder"; client_share: the most of the fitting draft slots one client may hold;
        keepalive: the MQTT keepalive of every link it opens (a silent broker node is left after ~1.5-2x).
        verify_engine: a target the hub verifies drafting devices' drafts with (the reverse star,
        server/hub_verify.py), its tokenizer's fingerprint verify_fp (default: tokenizer_fp), its tokenizer for
        grammars verify_grammars (grammar_tokenizer() or a function making it; None: it follows none)."""
        if (draft_engine is not None or draft_core is not None) and not tokenizer_fp:
            raise ValueError("the hub's draft service needs the tokenizer fingerprint of its model")
        if sun_pools and not sun_isolated:
            raise ValueError("SUN decoder pools per task (sun_pools) need sun_isolated=True")
        if sun_decoder is not None and not sun:
            raise ValueError("a hub-hosted SUN decoder needs SUN routing (sun=True)")
        self.hub_id = hub_id
        self.peers = HubPeers(hub_id, hubs, hub_silent_s) if hubs else None   # None: the only hub
        self.broker_url, self.broker_kind, self.port, self.acl = broker_url, broker, port, acl
        self.listeners = list(listeners)      # server.broker.Listener: addresses beyond loopback
        self.username, self.password = username, password
        self.keepalive = keepalive
        self.draft_engine, self.tokenizer_fp, self.limits = draft_engine, tokenizer_fp, limits
        self.draft_core = draft_core          # a prebuilt draft core (edge/star/draft_kinds.py), or None
        self.status_every, self.ctl_key = status_every, ctl_key
        self.link = link
        self.broker = None                    # the broker we run, if any
        self.node: Optional[DraftNode] = None
        self._draft_link = None               # its own connection, with its own will
        self.sun, self.sun_isolated, self.sun_pools = sun, sun_isolated, sun_pools
        self.sun_decoder = sun_decoder
        self.router: Optional[SunRouter] = None
        self.sun_node = None                  # DecoderNode of sun_decoder
        self._sun_link = None                 # its own connection
        self.registry = Registry(client_share=client_share)
        self.epoch = 0.0
        self.counters = {"joins": 0, "refused": 0, "bad_join": 0, "replayed_join": 0}
        self._join_nonces = SeenIds()         # (client, nonce) of recent joins: a replay opens no session
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._live = False
        self.discovery: Optional[Discovery] = None   # asks every service for a hello (no retained needed)
        self.verify = None if verify_engine is None else VerifySide(
            verify_engine, verify_fp or tokenizer_fp, verify_limits, ctl_key, client_share, verify_grammars)

    @property
    def url(self) -> str:
        return self.broker.url if self.broker is not None else (self.broker_url or "memory://")

    @property
    def service(self) -> Optional[DraftService]:
        return self.node.service if self.node else None

    # ---- lifecycle ----
    def start(self) -> "Hub":
        self.epoch = time.time()
        if self.link is None:
            if self.broker_url is None:
                from server.broker import start_broker
                self.broker = start_broker(self.broker_kind, port=self.port, acl=self.acl,
                                           listeners=self.listeners)
                if self.acl:
                    self.username, self.password = self.broker.hub_user, self.broker.hub_password
            self.link = self._mqtt_link(self.url, self.hub_id)
        self.link.set_will(self._status_topic(), encode(HubStatus(self.hub_id, False, self.epoch)), retain=True)
        # announce ourselves only once the draft service is registered, or early
        # joins would be refused for want of a draft service
        self.link.on_connection(lambda up: up and self._live and self.publish_status())
        self.link.on_connection(lambda up: up and self.registry.liveness.forget_probes())
        self.link.subscribe(JOIN_SUB, self._on_join)
        self.link.subscribe(DRAFTS_SUB, self._on_hello)
        for peer in (self.peers.others() if self.peers is not None else ()):
            self.link.subscribe(hub_hello_topic(peer), lambda t, p: self.peers.on_status(t, p, self._live))
        self.link.connect()
        self.discovery = Discovery(self.link, self.hub_id, self.ctl_key).start()
        if self.sun:
            self.router = SunRouter(self.link, isolated=self.sun_isolated, pools=self.sun_pools,
                                    ctl_key=self.ctl_key, owns=self.owns if self.peers else None).start()
            if self.sun_decoder is not None:
                from edge.sun.decoder_node import DecoderNode
                # its own connection: megabytes of KV must not queue behind (or ahead of) draft traffic
                did = f"{self.hub_id}-decoder"
                self._sun_link = self._second_link(did)
                self.sun_node = DecoderNode(self.sun_decoder, self._sun_link, did, ctl_key=self.ctl_key)
                if self._sun_link is not self.link:
                    self._sun_link.set_will(sun_hello_topic(did), self.sun_node.will())
                    self._sun_link.connect()
                self.sun_node.start()
        if self.draft_engine is not None or self.draft_core is not None:
            did = f"{self.hub_id}-draft"
            # one path builds every kind of draft core (edge/star/draft_kinds.py): a draft_engine is a model draft
            svc = self.draft_core or make_draft_core("model", self.draft_engine, self.limits, name=did)
            # its own connection and will: a killed hub must not leave an online hello of its
            # draft service behind (a hub without that service would assign sessions to it)
            self._draft_link = self._second_link(did)
            self.node = DraftNode(svc, self._draft_link, did, self.tokenizer_fp,
                                  ctl_key=self.ctl_key, on_closed=self._closed)
            if self._draft_link is not self.link:
                self._draft_link.set_will(draft_hello_topic(did), self.node.will())
                self._draft_link.connect()
            self.registry.update_service(self.node.status(), local=self.node)
            self.node.start()
        if self.verify is not None:
            vlink = self._second_link(f"{self.hub_id}-verify")
            self.verify.start(self.hub_id, vlink, shared=vlink is self.link)
        self._live = True
        self.publish_status()
        self._stop.clear()
        self._thread = threading.Thread(target=self._status_loop, name=f"{self.hub_id}-status", daemon=True)
        self._thread.start()
        log.info("hub %s up on %s (epoch %.3f)", self.hub_id, self.url, self.epoch)
        return self

    def stop(self) -> None:
        """Leave cleanly: mark offline (retained), close sessions, stop our broker."""
        self._stop_parts(announce=True)
        if self.router is not None:
            self.router.stop()
        if self.link is not None:
            self.link.publish(self._status_topic(), encode(HubStatus(self.hub_id, False, self.epoch)),
                              kind="status")
            self.link.close()
        self._stop_broker()

    def kill(self) -> None:
        """Die abruptly (fault tests): no goodbye, the broker publishes our will."""
        self._stop_parts(announce=False)
        crash = getattr(self.link, "crash", None)
        (crash or self.link.close)()
        self._stop_broker()

    def _stop_parts(self, announce: bool) -> None:
        """Stop the status loop, discovery and the nodes the hub runs (its draft service, verify
        service, SUN decoder), each saying goodbye or not, and close their own links (or crash them)."""
        self._stop.set()
        if self.discovery is not None:
            self.discovery.stop()
        self._live = False
        verify = self.verify if self.verify is not None and self.verify.node is not None else None
        for part, link in ((self.node, self._draft_link), (verify, verify and verify.link),
                           (self.sun_node, self._sun_link)):
            if part is None:
                continue
            part.stop(announce=announce)          # a SUN decoder announces itself offline (retained)
            if link is not self.link:
                (link.close if announce else getattr(link, "crash", None) or link.close)()

    def _second_link(self, name: str):
        """Another connection to our broker as the hub's user (an in-memory bus: another link on it)."""
        if isinstance(self.link, MqttLink):
            return self._mqtt_link(self.link.url, name)
        bus = getattr(self.link, "bus", None)
        if bus is not None:
            from edge.wire.memory_link import MemoryLink
            return MemoryLink(bus)
        return self.link                      # some other Link: share it

    def _mqtt_link(self, url: str, name: str) -> MqttLink:
        return MqttLink(url, client_id=f"{name}-{int(self.epoch * 1000) % 10**9}", username=self.username,
                        password=self.password, keepalive=self.keepalive)

    def _revive_broker(self) -> None:
        """Our Mosquitto died under us (kill -9, the OOM killer): start it again on its port with
        the same users; every link reconnects by itself and every node says hello again."""
        proc = getattr(self.broker, "proc", None)
        if proc is None or proc.poll() is None or self._stop.is_set():
            return
        log.warning("hub %s: its Mosquitto died (exit %s); starting it again on %s",
                    self.hub_id, proc.returncode, self.url)
        if proc.stderr:
            proc.stderr.close()
        self.counters["broker_restarts"] = self.counters.get("broker_restarts", 0) + 1
        self.broker.start()

    def _stop_broker(self) -> None:
        if self.broker is not None:
            close = getattr(self.broker, "close", None) or self.broker.stop
            close()

    def __enter__(self) -> "Hub":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # ---- status ----
    def status(self) -> HubStatus:
        return HubStatus(self.hub_id, True, self.epoch, self.registry.count(),
                         self.registry.online_services()[:256])

    def publish_status(self) -> None:
        self.link.publish(self._status_topic(), encode(self.status()), kind="status")

    def _status_topic(self) -> str:
        """ss/hub/status for the only hub; each of several its own (one retained topic for two
        hubs would flip between their epochs, and every device would drop its sessions)."""
        return STATUS_TOPIC if self.peers is None else hub_hello_topic(self.hub_id)

    # ---- the other hubs (server/hub_peers.py) ----
    def live_hubs(self) -> list:
        """The hubs this one counts as live, itself included (while it runs)."""
        return [self.hub_id] if self.peers is None else self.peers.live(self._live)

    def owns(self, client: str) -> bool:
        """Whether this hub serves `client` (a join naming no hub, a SUN request): with one hub,
        always; with several, once it has announced itself for two status periods, if it is the
        client's owner among the live hubs."""
        return self.peers is None or self.peers.owns(client, self._live,
                                                     settled=time.time() - self.epoch >= 2 * self.status_every)

    def _status_loop(self) -> None:
        while not self._stop.wait(self.status_every):
            try:
                self._revive_broker()
                if self.node is not None:
                    self.registry.update_service(self.node.status(), local=self.node)
                if self.verify is not None:
                    self.verify.refresh()
                self.registry.sweep()             # silent or unanswering services: offline
                if self.peers is not None:
                    self.peers.sweep(self._live)
                if self.router is not None:
                    self.router.sweep()
                self.publish_status()
            except Exception:
                log.exception("hub %s: status update failed", self.hub_id)

    def snapshot(self) -> dict:
        """Registry, counters and the own draft service's measurements (JSON-ready)."""
        out = {"hub": self.hub_id, "epoch": self.epoch, "url": self.url, "counters": dict(self.counters),
               "registry": self.registry.snapshot()}
        if self.node is not None:
            out["draft"] = self.node.service.stats.snapshot()
            out["dropped"] = self.node.dropped
        if self.verify is not None:
            out["verify"] = self.verify.snapshot()
        if self.peers is not None:
            out["hubs"] = self.peers.snapshot(self._live)
        if self.router is not None:
            out["sun"] = self.router.snapshot()
            if self.sun_node is not None:
                out["sun"]["decoder"] = {"id": self.sun_node.id, **self.sun_node.stats,
                                         "dropped": dict(self.sun_node.dropped)}
        return out

    def telemetry(self) -> dict:
        """Counters for the hub's own Telemetry (edge/telemetry/readings.py): its draft service's, if it
        runs one, with the star's sessions and the joins it dropped."""
        out = self.node.telemetry() if self.node is not None else {}
        dropped = dict(out.get("dropped", {}))
        dropped["bad_join"] = dropped.get("bad_join", 0) + self.counters["bad_join"]
        return {**out, "sessions": self.registry.count(), "dropped": dropped}

    # ---- joins ----
    def _reply(self, client: str, joined: Joined) -> None:
        self.link.publish(joined_topic(client), encode(joined), kind="control")

    def _on_join(self, topic: str, payload: bytes) -> None:
        try:
            _, ids = parse_topic(topic)
            join = decode(payload)
        except ProtocolError as e:
            self.counters["bad_join"] += 1
            log.info("hub: dropped a join on %s: %s", topic, e)
            return
        if not isinstance(join, Join) or join.client != ids["client"]:
            self.counters["bad_join"] += 1     # a join must come from its own client's topic
            return
        if not self._for_me(join):
            return                             # another hub's: it answers
        if join.nonce and not self._join_nonces.add((join.client, join.nonce)):
            self.counters["replayed_join"] += 1   # every join draws a fresh nonce (HubClient.join_async)
            log.log(logging.WARNING if self.counters["replayed_join"] == 1 else logging.DEBUG,
                    "hub: dropped a replayed join of %s (nonce %s)", join.client, join.nonce)
            return
        client = join.client
        side = self.verify.registry if join.role == "drafter" and self.verify is not None else self.registry
        release_ended(side, join, self.link, self.ctl_key)     # their byes may come after this join
        if join.role == "drafter":                 # the reverse star (server/hub_verify.py)
            self._reply(client, answer_drafter(self.verify, join, self.counters))
            return
        try:
            svc, sid, secret = self.registry.admit(join)
            if svc.local is not None:
                try:
                    svc.local.assign(client, sid, secret)
                except DraftRefused as e:
                    self.registry.release(sid)
                    raise Refusal(e.reason) from None
                self.registry.update_service(svc.local.status(), local=svc.local)
            else:
                assign = SessionAssign(svc.name, client, sid, secret, join.gamma, join.sampling)
                self.link.publish(draft_ctl_topic(svc.name), encode(assign, self.ctl_key), kind="control")
        except Refusal as r:
            self.counters["refused"] += 1
            log.info("hub: refused %s: %s", client, r.reason)
            self._reply(client, Joined(client, False, r.reason[:1024], nonce=join.nonce))
            return
        self.counters["joins"] += 1
        self._reply(client, Joined(client, True, "", sid, secret, svc.name, up_topic(client, sid, svc.name),
                                   down_topic(client, sid, svc.name), join.nonce))

    def _for_me(self, join: Join) -> bool:
        if join.hub:
            return join.hub == self.hub_id
        return self.owns(join.client)          # a device that names no hub: its owner in our view

    def _on_hello(self, topic: str, payload: bytes) -> None:
        if not payload:
            return
        try:
            _, ids = parse_topic(topic)
            hello = decode(payload, self.ctl_key)
        except ProtocolError:
            return
        if self.node is not None and ids["service"] == self.node.id:
            return                                  # our own; the registry already knows it
        if isinstance(hello, SessionRelease) and hello.service == ids["service"]:
            info = self.registry.sessions.get(hello.sid)
            if info is not None and info.service == hello.service:
                self.registry.release(hello.sid)    # a device's service ended a session
            return
        if not isinstance(hello, DraftHello) or hello.service != ids["service"]:
            return
        if self.registry.update_service(hello):     # a retained hello proves nothing: ask
            self.link.publish(draft_ctl_topic(hello.service), encode(Probe(hello.service), self.ctl_key),
                              kind="control")

    def _closed(self, sid: str, reason: str) -> None:
        self.registry.release(sid)

