"""Replay protection beside the session: each session's seq must rise."""
from __future__ import annotations

import threading


class ReplayGuard:
    """Per-session monotonic seq: a seq not above the last accepted one is dropped
    and counted. Thread-safe (MQTT callbacks run on the network thread)."""

    def __init__(self) -> None:
        self._last: dict[str, int] = {}
        self._lock = threading.Lock()
        self.dropped = 0
        self.dropped_by_sid: dict[str, int] = {}

    def accept(self, sid: str, seq: int) -> bool:
        with self._lock:
            if seq <= self._last.get(sid, -1):
                self.dropped += 1
                self.dropped_by_sid[sid] = self.dropped_by_sid.get(sid, 0) + 1
                return False
            self._last[sid] = seq
            return True

    def last(self, sid: str) -> int:
        with self._lock:
            return self._last.get(sid, -1)

    def forget(self, sid: str) -> None:
        with self._lock:
            self._last.pop(sid, None)
            self.dropped_by_sid.pop(sid, None)
