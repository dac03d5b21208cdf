"""A draft node whose byes wait: the order a busy draft service gives them, on demand.

A target's bye goes to the draft service (its session's up topic); the service's loop handles it
between steps and only then tells the hub (SessionRelease, or the hub's own service's callback).
The target's next join goes to the hub directly, so on a busy service it arrives first. `HeldByes`
plays that without a busy machine: the node keeps every bye unhandled until `release()`.
"""
from __future__ import annotations

import threading

from edge.wire.protocol import Bye


class HeldByes:
    """Patches one node (edge/star/draft_node.py) so that its byes wait for `release()`."""

    def __init__(self, node) -> None:
        self.node, self.held, self._lock = node, [], threading.Lock()
        self._holding = True
        self._handle = node.handle
        node.handle = self._handle_or_hold          # Node._handle_input calls self.handle

    def _handle_or_hold(self, kind: str, msg) -> None:
        if kind == "up" and isinstance(msg[0], Bye):
            with self._lock:
                if self._holding:
                    self.held.append((kind, msg))
                    return
        self._handle(kind, msg)

    def count(self) -> int:
        with self._lock:
            return len(self.held)

    def release(self) -> None:
        """Handle the held byes (on the node's loop, in order) and stop holding."""
        with self._lock:
            held, self.held, self._holding = self.held, [], False
        for item in held:
            self.node.put(*item)
