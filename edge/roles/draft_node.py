"""A draft service on the MQTT star: sessions in, signed answers out.

The node subscribes to every session's up topic (one wildcard, so no
per-session subscription round trip sits between a join and its first
request), opens each message with the session's key (a bad HMAC, a replayed
seq or a session it does not serve is dropped and counted), and hands
requests to the DraftService's Q_in. Answers go back signed on the session's
down topic. Sessions arrive from the hub: directly (`assign`, the hub's own
service) or as a SessionAssign on ss/d/{service}/ctl (a service on a device,
`edge-agent run --role draft`). A retained DraftHello tells the hub what the
service speaks (tokenizer fingerprint, vocabulary) and how loaded it is.
"""
from __future__ import annotations

import logging
import threading
from typing import Callable, Optional

from edge.link import Link
from edge.protocol import (Bye, DraftHello, DraftRequest, ProtocolError, session_up_sub,
                           SessionAssign, SessionRelease, decode, down_topic, draft_ctl_topic,
                           draft_hello_topic, encode)
from edge.roles.draft import DraftRefused, DraftService
from edge.roles.session import SessionKeys

log = logging.getLogger(__name__)


class DraftNode:
    def __init__(self, service: DraftService, link: Link, service_id: str, tokenizer_fp: str,
                 hello_every: float = 2.0, ctl_key: Optional[bytes] = None,
                 on_closed: Optional[Callable[[str, str], None]] = None):
        self.service, self.link, self.id = service, link, service_id
        self.tokenizer_fp = tokenizer_fp
        self.hello_every = hello_every
        self.ctl_key = ctl_key
        self.on_closed = on_closed or (lambda sid, why: None)
        self.keys = SessionKeys()
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._busy_mark = (0.0, 0.0)
        self._busy = 0.0

    @property
    def dropped(self) -> dict:
        """Messages dropped by reason (auth = bad HMAC, replay, unknown_session, ...)."""
        return dict(self.keys.dropped)

    # ---- lifecycle ----
    def will(self) -> bytes:
        """The DraftHello(online=False) to set as the link's will (own link only)."""
        return encode(self._hello(online=False), self.ctl_key)

    def start(self) -> "DraftNode":
        self.service.set_sink(self._send)
        self.service.set_on_evict(lambda sid, why: self._closed(sid, "timeout"))
        self.link.subscribe(session_up_sub(self.id), self._on_up)
        self.link.subscribe(draft_ctl_topic(self.id), self._on_ctl)
        self.link.on_connection(lambda up: up and self.hello())
        self.service.start()
        self.hello()
        self._thread = threading.Thread(target=self._hello_loop, name=f"hello-{self.id}", daemon=True)
        self._thread.start()
        return self

    def stop(self, announce: bool = True) -> None:
        self._stop.set()
        if announce:
            try:
                self.link.publish(draft_hello_topic(self.id),
                                  encode(self._hello(online=False), self.ctl_key), kind="status")
            except Exception:
                pass
        self.service.stop()
        for sid in self.service.sessions():
            self.service.close(sid, "shutdown")
            self.keys.remove(sid)

    def _hello(self, online: bool = True, window: bool = False) -> DraftHello:
        if window:                                  # busy ratio since the last periodic hello
            st = self.service.stats
            busy, total = st.busy_s, st.busy_s + st.idle_s + st.ahead_s
            b0, t0 = self._busy_mark
            self._busy_mark = (busy, total)
            self._busy = (busy - b0) / (total - t0) if total - t0 > 0 else 0.0
        ratio = self._busy
        lim = self.service.limits
        return DraftHello(self.id, self.tokenizer_fp, self.service.vocab_size, online,
                          lim.max_sessions, lim.max_gamma, len(self.service.sessions()),
                          min(1.0, max(0.0, ratio)))

    def status(self) -> DraftHello:
        """The current DraftHello without publishing it (the hub's own service)."""
        return self._hello()

    def hello(self, window: bool = False) -> None:
        self.link.publish(draft_hello_topic(self.id), encode(self._hello(window=window), self.ctl_key),
                          kind="status")

    def _hello_loop(self) -> None:
        while not self._stop.wait(self.hello_every):
            try:
                self.hello(window=True)
            except Exception:
                log.exception("draft %s: hello failed", self.id)

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
        self.link.publish(draft_hello_topic(self.id), encode(SessionRelease(self.id, sid, reason),
                                                             self.ctl_key), kind="control")

    # ---- traffic ----
    def _on_up(self, topic: str, payload: bytes) -> None:
        msg = self.keys.open(topic, payload, self.service.vocab_size)
        if isinstance(msg, DraftRequest):
            self.service.submit(msg)
        elif isinstance(msg, Bye):
            self.release(msg.sid, "bye")

    def _send(self, sid: str, msg) -> None:
        client = self.keys.client(sid)
        if client is None:
            return                                    # closed meanwhile
        self.link.publish(down_topic(client, sid, self.id), self.keys.seal(msg), kind="draft")

    def _on_ctl(self, topic: str, payload: bytes) -> None:
        try:
            msg = decode(payload, self.ctl_key)
        except ProtocolError as e:
            self.keys.drop(f"ctl_{e.code}")
            return
        if isinstance(msg, SessionAssign) and msg.service == self.id:
            try:
                self.assign(msg.client, msg.sid, msg.secret)
            except DraftRefused as e:
                log.warning("draft %s: session %s refused: %s", self.id, msg.sid, e.reason)
            self.hello()
        elif isinstance(msg, SessionRelease) and msg.service == self.id:
            self.release(msg.sid, "released")
            self.hello()
