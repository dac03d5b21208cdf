"""Admission to a device's generation: up to `parallel` requests generate at once, the next
`queue` wait their turn (first come, first served), and past that a request is refused at
once with a 503 and Retry-After (`Unavailable`) instead of piling up threads.

The generations admitted together share the engine (edge/engines/batched_calls.py: their
forwards go to it as one batched call per round), each on its own sequence and, on a StarSD
target, its own hub session.
"""
from __future__ import annotations

import threading
from collections import deque
from contextlib import contextmanager
from typing import Iterator

DEFAULT_PARALLEL = 2
DEFAULT_QUEUE = 16
RETRY_AFTER_S = 2

__all__ = ["Admission", "DEFAULT_PARALLEL", "DEFAULT_QUEUE", "Unavailable"]


class Unavailable(RuntimeError):
    """Raised by generate when the service cannot take the request now: a 503 with Retry-After."""

    def __init__(self, message: str, retry_after: int = 5):
        super().__init__(message)
        self.retry_after = retry_after


class Admission:
    """`parallel` generations at once, `queue` more waiting; `slot()` is one request's turn."""

    def __init__(self, parallel: int = 1, queue: int = DEFAULT_QUEUE, retry_after: int = RETRY_AFTER_S):
        if isinstance(parallel, bool) or not isinstance(parallel, int) or parallel < 1:
            raise ValueError(f"parallel must be an integer >= 1 (requests generating at once), got {parallel!r}")
        if isinstance(queue, bool) or not isinstance(queue, int) or queue < 0:
            raise ValueError(f"queue must be an integer >= 0 (requests waiting), got {queue!r}")
        self.parallel, self.queue, self.retry_after = parallel, queue, retry_after
        self._cv = threading.Condition()
        self._waiting: deque = deque()        # tickets, first come first
        self.running = 0
        self.stats = {"admitted": 0, "queued": 0, "refused": 0}

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    @contextmanager
    def slot(self) -> Iterator[None]:
        """Hold one of the `parallel` places while the block runs (waiting in the queue for one);
        Unavailable when the queue is full."""
        self._enter()
        try:
            yield
        finally:
            with self._cv:
                self.running -= 1
                self._cv.notify_all()

    def _enter(self) -> None:
        with self._cv:
            if self.running < self.parallel and not self._waiting:
                self.running += 1
                self.stats["admitted"] += 1
                return
            if len(self._waiting) >= self.queue:
                self.stats["refused"] += 1
                raise Unavailable(f"the device is busy: {self.running} requests generating (--parallel "
                                  f"{self.parallel}) and {len(self._waiting)} waiting (--queue {self.queue}); "
                                  f"retry in {self.retry_after} s", self.retry_after)
            ticket = object()
            self._waiting.append(ticket)
            self.stats["queued"] += 1
            try:
                while self._waiting[0] is not ticket or self.running >= self.parallel:
                    self._cv.wait()
            except BaseException:
                self._waiting.remove(ticket)
                self._cv.notify_all()
                raise
            self._waiting.popleft()
            self.running += 1
            self.stats["admitted"] += 1
            self._cv.notify_all()             # the next in line may fit too
