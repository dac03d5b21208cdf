"""The queue of prompts a SUN prefill worker holds before it prefills them (full copy or adapters)."""
from __future__ import annotations

import itertools
from collections import deque
from typing import Deque, Optional


class QueueFull(RuntimeError):
    """A prefill worker already holds max_queue prompts: the caller retries or goes elsewhere."""


class PromptQueue:
    """FIFO of (request id, ...) items, bounded by max_queue; a base of the prefill workers."""

    def __init__(self, name: str, max_queue: int):
        if max_queue < 1:
            raise ValueError("max_queue must be >= 1")
        self.name, self.max_queue = name, max_queue
        self._ids = itertools.count(1)
        self._queue: Deque[tuple] = deque()

    def _admit(self, request_id: Optional[str], item: tuple, elsewhere: str) -> str:
        """Queue (rid, *item) and return rid; past max_queue raise QueueFull naming `elsewhere`."""
        if len(self._queue) >= self.max_queue:
            raise QueueFull(f"{self.name}: {self.max_queue} prompts are queued already, its limit; "
                            f"retry later or add {elsewhere}")
        rid = request_id or f"{self.name}#{next(self._ids)}"
        self._queue.append((rid, *item))
        return rid

    def cancel(self, request_id: str) -> bool:
        """Drop a queued prompt; False if it is not queued (unknown, or prefilled already)."""
        for item in self._queue:
            if item[0] == request_id:
                self._queue.remove(item)
                return True
        return False

    @property
    def load(self) -> int:
        """Prompts queued."""
        return len(self._queue)

    def has_work(self) -> bool:
        return bool(self._queue)
