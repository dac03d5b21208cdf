"""An in-process pub/sub bus with the `Link` interface (edge/wire/link.py): tests and one-process demos.

Same semantics as MQTT as far as the kit relies on them: `+` / `#` filters,
retained messages (an empty one clears), a last will published when a link
drops, callbacks on the link's own delivery thread; go_down()/come_up() play
a broker outage.
"""
from __future__ import annotations

import queue
import threading
from typing import Optional

from edge.wire.link import Link, LinkError, check_topic
from edge.wire.topic_match import topic_matches_sub


class MemoryBus:
    """An in-process broker for MemoryLinks: wildcards, retained messages, wills,
    and go_down()/come_up() to play a broker outage."""

    url = "memory://"

    def __init__(self) -> None:
        self._links: list[MemoryLink] = []
        self._retained: dict[str, bytes] = {}
        self._lock = threading.RLock()
        self.up = True

    def _attach(self, link: "MemoryLink") -> None:
        with self._lock:
            if link not in self._links:
                self._links.append(link)

    def _detach(self, link: "MemoryLink") -> None:
        with self._lock:
            if link in self._links:
                self._links.remove(link)

    def _route(self, topic: str, payload: bytes, retain: bool) -> None:
        with self._lock:
            if retain:
                if payload:
                    self._retained[topic] = payload
                else:                            # MQTT: an empty retained message clears it
                    self._retained.pop(topic, None)
            targets = [ln for ln in self._links if ln._wants(topic)]
        for ln in targets:
            ln._inbox.put((topic, payload))

    def _retained_for(self, pattern: str) -> list[tuple[str, bytes]]:
        with self._lock:
            return [(t, p) for t, p in self._retained.items() if topic_matches_sub(pattern, t)]

    def go_down(self) -> None:
        """The broker dies: links drop, retained messages are lost, wills are not sent."""
        with self._lock:
            self.up = False
            self._retained.clear()
            links = list(self._links)
        for ln in links:
            ln._set_up(False)

    def come_up(self) -> None:
        """The broker is back: links reconnect and re-subscribe."""
        with self._lock:
            self.up = True
            links = list(self._links)
        for ln in links:
            ln._set_up(True)


class MemoryLink(Link):
    """Same semantics as MqttLink, in-process; for unit tests."""

    def __init__(self, bus: MemoryBus, client_id: Optional[str] = None) -> None:
        super().__init__(client_id)
        self.bus = bus
        self._inbox: queue.Queue = queue.Queue()
        self._thread: Optional[threading.Thread] = None
        self._up = False
        self._will: Optional[tuple[str, bytes, bool]] = None

    def connect(self, timeout: Optional[float] = 10.0) -> "MemoryLink":
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name=f"memlink-{self.client_id}", daemon=True)
            self._thread.start()
            self.bus._attach(self)
        if self.bus.up:
            self._set_up(True)
        elif timeout is not None:
            raise LinkError("the memory bus is down")
        return self

    def _set_up(self, up: bool) -> None:
        if up == self._up:
            return
        self._up = up
        if up:
            with self._lock:
                patterns = list(self._subs)
            for p in patterns:
                self._subscribe(p)
        self._notify(up)

    def _wants(self, topic: str) -> bool:
        with self._lock:
            return self._up and any(topic_matches_sub(p, topic) for p in self._subs)

    def _run(self) -> None:
        while True:
            item = self._inbox.get()
            if item is None:
                return
            self._dispatch(*item)

    def publish(self, topic: str, payload: bytes, kind: str = "control") -> bool:
        check_topic(topic)
        _, retain = self._qos(kind)
        if not (self._up and self.bus.up):
            self.stats["send_failed"] += 1
            return False
        self.stats["sent"] += 1
        self.bus._route(topic, bytes(payload), retain)
        return True

    def _subscribe(self, pattern: str) -> bool:
        if self._up:
            for t, p in self.bus._retained_for(pattern):
                self._inbox.put((t, p))
        return True

    def set_will(self, topic: str, payload: bytes, retain: bool = True) -> None:
        check_topic(topic)
        self._will = (topic, bytes(payload), retain)

    def is_connected(self) -> bool:
        return self._up and self.bus.up

    def close(self) -> None:
        self._stop(send_will=False)

    def crash(self) -> None:
        """Die without a clean disconnect: the bus publishes the will."""
        self._stop(send_will=True)

    def _stop(self, send_will: bool) -> None:
        if self._thread is None:
            return
        self.bus._detach(self)
        if send_will and self._will and self.bus.up:
            self.bus._route(*self._will)
        was_up, self._up = self._up, False
        thread, self._thread = self._thread, None
        self._inbox.put(None)
        if thread is not threading.current_thread():
            thread.join(timeout=5)
        if was_up:
            self._notify(False)
