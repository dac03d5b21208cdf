"""The base of every networked role: a core on an EngineLoop, announced on the star.

A node (DraftNode, PrefillNode, DecoderNode) puts one core -- a DraftService,
a PrefillWorker, a SharedDecoder -- behind an MQTT link. What they share
lives here:

* a retained hello that says what the node serves and how loaded it is; the
  link's last will (`will()`) is the same hello with online=False. It goes out
  at start, on every reconnect, whenever `status_key()` changes and at least
  every `hello_every` seconds; `on_hello_period()` runs just before a periodic
  one (a node measures what that hello reports over the period).
* control messages on the node's ctl topic, decoded with the deployment's
  control key: a bad signature or body is dropped and counted, never queued.
  A Probe is answered with a fresh hello (the hub's proof that a retained
  hello is not a dead process's).
* discovery without retained messages: every node listens on ss/discover and
  answers a Discover (the hub's, at its start, reconnect and periodically) with
  a fresh hello, so a hub on a clustered broker (no cluster-wide retained
  hellos, none through wildcards) finds every node at once.
* drop counters by reason, and `fresh(id)`: a job or assignment id seen
  before is a replay, dropped and counted.
* the loop: network callbacks `put` (kind, message) inputs; `handle` runs
  them in the loop's thread, which alone touches the core, and `publish`
  sends each output of a step. `tick` runs every turn. While one step runs
  longer than `hello_every`, a heartbeat thread sends the hello instead
  (edge/runtime/heartbeat.py), up to a bound past which the step is a hang.
* `telemetry()`: one JSON-ready dict of the node's counters, for dashboards.
* `stop(announce)`: stop the loop, then (announce) publish the offline hello.
"""
from __future__ import annotations

import logging
import threading
import time
import weakref
from typing import Callable, Dict, Hashable, Optional

from edge.wire.link import Link
from edge.wire.protocol import DISCOVER_TOPIC, Discover, Probe, ProtocolError, decode, encode
from edge.runtime.heartbeat import StepHeartbeat
from edge.runtime.loop import EngineLoop
from edge.wire.seen_ids import SeenIds

log = logging.getLogger(__name__)

# nodes sharing one link share its one ss/discover subscription (a link keeps one callback per filter)
_listeners_lock = threading.Lock()
_discovery_listeners: "weakref.WeakKeyDictionary[Link, list]" = weakref.WeakKeyDictionary()


def _listen_for_discovery(node: "Node") -> None:
    with _listeners_lock:
        nodes = _discovery_listeners.setdefault(node.link, [])
        nodes.append(node)
        first = len(nodes) == 1
    if first:
        node.link.subscribe(DISCOVER_TOPIC, lambda topic, payload: [n._on_ctl(topic, payload) for n in list(nodes)])


def _stop_listening(node: "Node") -> None:
    with _listeners_lock:
        nodes = _discovery_listeners.get(node.link, [])
        if node in nodes:
            nodes.remove(node)


class Node:
    role = ""                                             # "draft", "prefill", "decoder"

    def __init__(self, core, link: Link, node_id: str, ctl_key: Optional[bytes] = None,
                 hello_every: float = 2.0, idle_wait: float = 0.25,
                 clock: Callable[[], float] = time.monotonic):
        self.link, self.id, self.ctl_key, self.hello_every = link, node_id, ctl_key, hello_every
        self.served = 0                                   # jobs / assignments taken
        self.seen = SeenIds()
        self._drops: Dict[str, int] = {}
        self._drops_lock = threading.Lock()
        self._said: Optional[Hashable] = None
        self._period_at = time.monotonic()                # start of the current hello period
        self.loop = EngineLoop(core, f"{self.role}-{node_id}", handle=self._handle_input,
                               publish=self.publish, tick=self._tick, idle_wait=idle_wait,
                               on_idle=self.on_idle, clock=clock)
        # hellos while one step runs long (edge/runtime/heartbeat.py): the hub must not think us dead
        self.heartbeat = StepHeartbeat(self.loop, self._say_hello, hello_every, name=f"{self.role}-{node_id}-hb")

    # ---- what a role defines ----
    def hello_topic(self) -> str:
        raise NotImplementedError

    def ctl_topic(self) -> str:
        raise NotImplementedError

    def status(self, online: bool = True):
        """The hello message (online=False: the will)."""
        raise NotImplementedError

    def status_key(self) -> Hashable:
        """A hello goes out whenever this changes (default: only periodically)."""
        return None

    def on_hello_period(self) -> None:
        """Runs before each periodic hello."""

    def subscribe(self) -> None:
        """Subscriptions beyond the ctl topic."""

    def handle(self, kind: str, msg) -> None:
        """One input, in the loop's thread."""

    def publish(self, output) -> None:
        """One output of the core's step, in the loop's thread."""

    def tick(self, now: float) -> None:
        """Every loop turn (timeouts, evictions), in the loop's thread."""

    def on_idle(self, seconds: float) -> None:
        """After the loop waited `seconds` with nothing to do."""

    def on_stop(self) -> None:
        """After the loop stopped, before the offline hello."""

    # ---- drops and replays ----
    def drop(self, why: str) -> None:
        with self._drops_lock:
            n = self._drops[why] = self._drops.get(why, 0) + 1
        # the first of each reason is worth a warning; a flood of them only a debug line each
        log.log(logging.WARNING if n == 1 else logging.DEBUG, "%s %s: dropped a message (%s; %d so far)",
                self.role, self.id, why, n)

    @property
    def dropped(self) -> Dict[str, int]:
        """Messages dropped by reason (auth = bad HMAC, replay, not_mine, ...)."""
        with self._drops_lock:
            return dict(self._drops)

    def fresh(self, rid: str) -> bool:
        """False (and counted) for an id seen before: a replayed job is not served twice."""
        if not self.seen.add(rid):
            self.drop("replay")
            return False
        return True

    # ---- hello ----
    def will(self) -> bytes:
        """The offline hello to set as the link's will (before connect)."""
        return encode(self.status(online=False), self.ctl_key)

    def hello(self, force: bool = True) -> None:
        """Publish the hello (retained): forced, or when it changed or a period passed."""
        now = time.monotonic()
        key = self.status_key()
        due = now - self._period_at >= self.hello_every
        if not (force or due or key != self._said):
            return
        if due:
            self._period_at = now
            self.on_hello_period()
        self._said = key
        self._say_hello()

    def _say_hello(self) -> None:
        self.link.publish(self.hello_topic(), encode(self.status(), self.ctl_key), kind="status")

    # ---- lifecycle ----
    def start(self):
        self.link.subscribe(self.ctl_topic(), self._on_ctl)
        _listen_for_discovery(self)
        self.subscribe()
        self.link.on_connection(lambda up: up and self.hello())
        self.loop.start()
        self.hello()
        self.heartbeat.start()
        return self

    def stop(self, announce: bool = True) -> None:
        self.heartbeat.stop()
        self.loop.stop()
        _stop_listening(self)
        self.on_stop()
        if announce:
            try:
                self.link.publish(self.hello_topic(), self.will(), kind="status")
            except Exception:
                log.debug("%s %s: offline hello not sent", self.role, self.id, exc_info=True)

    def telemetry(self) -> dict:
        """Counters for edge/telemetry/readings.py (its docstring names the keys) and dashboards;
        roles add theirs (sessions, tokens, batch sizes, KV)."""
        loop = self.loop.stats.snapshot()
        return {"id": self.id, "role": self.role, "served": self.served, "dropped": self.dropped,
                "backlog": self.loop.backlog(), "loop": loop,
                "busy_s": loop["busy_s"], "wall_s": loop["busy_s"] + loop["idle_s"]}

    # ---- plumbing ----
    def put(self, kind: str, msg) -> None:
        self.loop.put((kind, msg))

    def _handle_input(self, item) -> None:
        kind, msg = item
        if kind == "ctl" and isinstance(msg, Probe):       # prove we are alive: a fresh hello
            if msg.target == self.id:
                self.hello()
            return
        if kind == "ctl" and isinstance(msg, Discover):    # a hub looks for its star: say hello
            self.hello()
            return
        self.handle(kind, msg)

    def _tick(self, now: float) -> None:
        self.tick(now)
        self.hello(force=False)

    def _on_ctl(self, topic: str, payload: bytes) -> None:
        try:
            msg = decode(payload, self.ctl_key)
        except ProtocolError as e:
            self.drop(f"ctl_{e.code}")
            return
        if not self.answer_on_arrival(msg):
            self.put("ctl", msg)

    def answer_on_arrival(self, msg) -> bool:
        """A control message answered in the link's thread, not queued behind a long step (True: done).
        Must only read what the loop's thread changes, and only publish."""
        return False

    def send(self, topic: str, msg, secret: bytes) -> None:
        """A message signed with a request's own secret."""
        self.link.publish(topic, encode(msg, secret), kind="control")
