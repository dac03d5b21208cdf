"""The star's devices as their telemetry says: the latest Telemetry of every client.

Subscribes to ss/dev/+/telemetry (retained, so every device that reported shows at once).
A payload that is not a valid Telemetry of the client its topic names is dropped and counted
by reason (`dropped`: the ProtocolError code -- format, auth, invalid... -- or
not_telemetry / wrong_client), never stored; an empty payload is a device that left
cleanly. `edge-hub top` renders `rows()`; the hub's /metrics exports them.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Dict, List, Optional, Tuple

from edge.wire.link import Link
from edge.wire.protocol import TELEMETRY_SUB, ProtocolError, Telemetry, decode, parse_topic

log = logging.getLogger(__name__)


class TelemetryBoard:
    def __init__(self, link: Link, ctl_key: Optional[bytes] = None):
        self.link, self.ctl_key = link, ctl_key
        self._latest: Dict[str, Telemetry] = {}
        self._dropped: Dict[str, int] = {}
        self._lock = threading.Lock()
        self.received = 0
        self.last_change = time.monotonic()      # a device came or went, or a report was dropped

    def start(self) -> "TelemetryBoard":
        self.link.subscribe(TELEMETRY_SUB, self._on_telemetry)
        return self

    def _drop(self, why: str, topic: str, detail: str = "") -> None:
        with self._lock:
            self._dropped[why] = self._dropped.get(why, 0) + 1
        self.last_change = time.monotonic()
        log.info("telemetry on %s dropped (%s) %s", topic, why, detail)

    def _on_telemetry(self, topic: str, payload: bytes) -> None:
        self.received += 1
        try:
            kind, ids = parse_topic(topic)
        except ProtocolError as e:
            self._drop(e.code, topic)
            return
        client = ids.get("client", "")
        if kind != "telemetry":
            self._drop("not_telemetry", topic)
            return
        if not payload:                             # cleared on a clean stop: the device left
            with self._lock:
                if self._latest.pop(client, None) is not None:
                    self.last_change = time.monotonic()
            return
        try:
            msg = decode(payload, self.ctl_key)
        except ProtocolError as e:
            self._drop(e.code, topic, e.reason)
            return
        if not isinstance(msg, Telemetry):
            self._drop("not_telemetry", topic, type(msg).__name__)
        elif msg.client != client:                  # a report must come from its own client's topic
            self._drop("wrong_client", topic, msg.client)
        else:
            with self._lock:
                if client not in self._latest:
                    self.last_change = time.monotonic()
                self._latest[client] = msg

    def rows(self, now: Optional[float] = None) -> List[Tuple[Telemetry, float]]:
        """(latest report, its age in seconds) of every device, by client id."""
        now = time.time() if now is None else now
        with self._lock:
            msgs = sorted(self._latest.values(), key=lambda m: m.client)
        return [(m, max(0.0, now - m.time)) for m in msgs]

    def messages(self) -> List[Telemetry]:
        with self._lock:
            return list(self._latest.values())

    @property
    def dropped(self) -> Dict[str, int]:
        with self._lock:
            return dict(self._dropped)
