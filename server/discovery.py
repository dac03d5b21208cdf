"""The hub's side of discovery by request and answer: it asks, every live node says hello.

The retained hellos on ss/hub/drafts/+ and ss/sun/workers/+ are a fast path only: a clustered
broker (RabbitMQ 3.10) keeps a retained message on the node where it was published and gives
none through a wildcard subscription, so a hub attached to another node would hear of a service
only at its next periodic hello. `Discovery` broadcasts a Discover on ss/discover when the hub
starts, on every reconnect (perhaps to another broker node) and every `every` seconds; each draft
service and SUN worker answers with a fresh hello, which the registry and the router take like
any hello (the first one is probed before it is trusted: server/liveness.py).
"""
from __future__ import annotations

import logging
import threading
from typing import Optional

from edge.wire.link import Link
from edge.wire.protocol import DISCOVER_TOPIC, Discover, encode

log = logging.getLogger(__name__)
DISCOVER_EVERY_S = 10.0        # a node re-announces every ~2 s anyway; this catches a lost answer


class Discovery:
    def __init__(self, link: Link, asker: str, ctl_key: Optional[bytes] = None,
                 every: float = DISCOVER_EVERY_S) -> None:
        if every <= 0:
            raise ValueError(f"discovery period must be positive seconds, got {every}")
        self.link, self.asker, self.ctl_key, self.every = link, asker, ctl_key, every
        self.sent = 0
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def start(self) -> "Discovery":
        self.link.on_connection(lambda up: up and not self._stop.is_set() and self.ask())
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name=f"{self.asker}-discovery", daemon=True)
        self._thread.start()
        self.ask()
        return self

    def ask(self) -> None:
        """Every live draft service and SUN worker: publish your hello now."""
        try:
            if self.link.publish(DISCOVER_TOPIC, encode(Discover(self.asker), self.ctl_key), kind="control"):
                self.sent += 1
        except Exception:                       # a closing link: the next period (or reconnect) asks again
            log.debug("%s: discovery request not sent", self.asker, exc_info=True)

    def _run(self) -> None:
        while not self._stop.wait(self.every):
            self.ask()

    def stop(self) -> None:
        self._stop.set()
