"""A draft service on the MQTT star: sessions in, signed answers out.

The node subscribes to every session's up topic (one wildcard, so no
per-session subscription round trip sits between a join and its first
request), opens each message with the session's key (a bad HMAC, a replayed
seq or a session it does not serve is dropped and counted), and queues
requests for its loop, which hands them to the DraftService's Q_in. Answers
go back signed on the session's down topic. Sessions arrive from the hub:
directly (`assign`, the hub's own service) or as a SessionAssign on
ss/d/{service}/ctl (a service on a device, `edge-agent run --role draft`).
A retained DraftHello tells the hub what the service speaks (tokenizer
fingerprint, vocabulary) and how loaded it is (busy ratio over the last
hello period).
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Callable, Dict, Optional

from edge.wire.link import Link
from edge.wire.protocol import (MAX_HELD, Bye, DraftHello, DraftRequest, ProtocolError, SessionAssign, SessionRelease,
                           down_topic, draft_ctl_topic, draft_hello_topic, encode, session_up_sub)
from edge.star.draft_limits import DraftRefused
from edge.star.draft_service import DraftService
from edge.runtime.node import Node
from edge.star.hub_client import SessionKeys

log = logging.getLogger(__name__)
DEFER_MAX_BYTES = 8 << 20   # up messages of sessions not known yet, waiting for the loop


class DraftNode(Node):
    role = "draft"
    requests = DraftRequest      # what its core takes from a session's up topic (a verify node: VerifyRequest)

    def __init__(self, service: DraftService, link: Link, service_id: str, tokenizer_fp: str,
                 hello_every: float = 2.0, ctl_key: Optional[bytes] = None,
                 on_closed: Optional[Callable[[str, str], None]] = None):
        evict_every = service.limits.evict_after_s / 4
        super().__init__(service, link, service_id, ctl_key, hello_every, idle_wait=min(0.25, evict_every),
                         clock=service.clock)
        self.service = service
        self.tokenizer_fp = tokenizer_fp
        self.on_closed = on_closed or (lambda sid, why: None)
        self.keys = SessionKeys()
        self._evict_every = min(1.0, evict_every)
        self._last_evict = service.clock()
        self._busy_mark = (0.0, 0.0)
        self._busy = 0.0
        self._deferred, self._defer_lock = 0, threading.Lock()   # bytes of not-yet-known sessions' messages

    @property
    def dropped(self) -> Dict[str, int]:
        """Messages dropped by reason (auth = bad HMAC, replay, unknown_session, ...)."""
        out = super().dropped
        for why, n in dict(self.keys.dropped).items():
            out[why] = out.get(why, 0) + n
        return out

    # ---- the node's hooks ----
    def hello_topic(self) -> str:
        return draft_hello_topic(self.id)

    def ctl_topic(self) -> str:
        return draft_ctl_topic(self.id)

    def subscribe(self) -> None:
        self.link.subscribe(session_up_sub(self.id), self._on_up)

    def on_hello_period(self) -> None:
        st = self.service.stats                      # busy ratio since the last periodic hello
        busy, total = st.busy_s, st.busy_s + st.idle_s + st.ahead_s
        b0, t0 = self._busy_mark
        self._busy_mark = (busy, total)
        self._busy = (busy - b0) / (total - t0) if total - t0 > 0 else 0.0

    def status(self, online: bool = True) -> DraftHello:
        """The current DraftHello (the hub reads its own service's without a publish)."""
        lim, held = self.service.limits, sorted(self.service.sessions())
        return DraftHello(self.id, self.tokenizer_fp, self.service.vocab_size, online,
                          lim.max_sessions, lim.max_gamma, len(held), min(1.0, max(0.0, self._busy)),
                          held=held if len(held) <= MAX_HELD else None, stamp=time.time())

    def telemetry(self) -> dict:
        """The node's counters plus the draft's own: busy ratio as the system model counts it
        (draft-ahead is not busy), drafted tokens, batch sizes, KV in use vs --max-kv-mb."""
        st, svc = self.service.stats, self.service
        snap = st.snapshot()
        out = {**super().telemetry(), "sessions": len(svc.sessions()), "tokens": st.drafted,
               "busy_s": st.busy_s, "wall_s": st.busy_s + st.idle_s + st.ahead_s,
               "batch_mean": snap["batch_size_mean"], "batch_max": snap["batch_size_max"]}
        engine = getattr(svc, "engine", None)        # a model's KV; a suffix-tree drafter holds none
        if engine is not None:
            out.update(kv_used_bytes=svc.kv_bytes(),    # as --max-kv-mb counts it (allocated)
                       kv_budget_bytes=svc.limits.max_kv_mb * 1e6)
        return out

    def on_idle(self, seconds: float) -> None:
        self.service.stats.add_idle(seconds)         # T_idle of the StarSD system model

    def tick(self, now: float) -> None:
        if now - self._last_evict > self._evict_every:
            self._last_evict = now
            for sid in self.service.evict_silent(now):
                self._closed(sid, "timeout")

    def on_stop(self) -> None:
        for sid in self.service.sessions():
            self.service.close(sid, "shutdown")
            self.keys.remove(sid)

    # ---- sessions ----
    def assign(self, client: str, sid: str, secret: bytes) -> None:
        """Serve a session (raises DraftRefused when the service is full)."""
        self.keys.add(sid, client, secret)
        try:
            self.service.open(sid)
        except DraftRefused:
            self.keys.remove(sid)
            raise

    def release(self, sid: str, reason: str = "released") -> None:
        if self.service.close(sid, reason):
            self._closed(sid, reason)

    def _closed(self, sid: str, reason: str) -> None:
        self.keys.remove(sid)
        self.on_closed(sid, reason)
        # tell the hub (its registry counts sessions per client); not retained, so
        # the retained DraftHello on the same topic stays
        self.link.publish(self.hello_topic(), encode(SessionRelease(self.id, sid, reason), self.ctl_key),
                          kind="control")

    # ---- traffic ----
    def _on_up(self, topic: str, payload: bytes) -> None:
        parts = topic.split("/")
        if len(parts) == 6 and parts[3] not in self.keys:
            # A session's SessionAssign reaches this link before its first request, but the loop
            # applies it: open the request there, after the assignment (a target on a fast link
            # otherwise loses its first round). Bounded: a flood of made-up sessions is dropped here.
            with self._defer_lock:
                defer = self._deferred + len(payload) <= DEFER_MAX_BYTES
                self._deferred += len(payload) if defer else 0
            if defer:
                self.put("up_raw", (topic, payload, self.loop.clock()))
                return
        msg = self.keys.open(topic, payload, self.service.vocab_size)
        if msg is not None:
            self.put("up", (msg, self.loop.clock()))   # when it came: the loop takes it after a batch

    def handle(self, kind: str, msg) -> None:
        if kind == "up_raw":
            topic, payload, t = msg
            with self._defer_lock:
                self._deferred -= len(payload)
            msg = self.keys.open(topic, payload, self.service.vocab_size)
            if msg is None:
                return
            kind, msg = "up", (msg, t)
        if kind == "up":
            msg, received = msg
            if isinstance(msg, self.requests):
                self.service.submit(msg, received)
            elif isinstance(msg, Bye):
                self.release(msg.sid, "bye")
        elif isinstance(msg, SessionAssign) and msg.service == self.id:
            try:
                self.assign(msg.client, msg.sid, msg.secret)
            except DraftRefused as e:
                log.warning("draft %s: session %s refused: %s", self.id, msg.sid, e.reason)
            self.hello()
        elif isinstance(msg, SessionRelease) and msg.service == self.id:
            self.release(msg.sid, "released")
            self.hello()

    def publish(self, output) -> None:
        sid, msg = output
        client = self.keys.client(sid)
        try:
            sealed = self.keys.seal(msg)
        except ProtocolError:
            client = None
        if client is None:
            return                                    # closed meanwhile
        self.link.publish(down_topic(client, sid, self.id), sealed, kind="draft")
