"""The one engine loop: the draft service, the shared decoder and the prefill worker all run on it.

Shaped like vLLM v1's engine core busy loop. A *core* (edge/runtime/core.py:
`EngineCore`) is a plain object with no thread and no I/O: `has_work()` says whether
`step()` would make progress, `step()` does one unit of work (a batch of drafts or
one draft-ahead step, one batched decode step, one prefill) and returns its outputs;
an optional `wake_in()` (`HeldBatchCore`) says how soon it wants a step with no new
input (a held batch). The loop owns the thread. Each turn it drains the inputs
that network callbacks queued with `put` into `handle`, calls `tick` (the node's
timers: hellos, evictions, timeouts), steps the core once and hands every output
to `publish`; a turn that found nothing to do waits for the next input, at most
`idle_wait` s.

Errors stay where they happen: an input, an output or a tick that raises is
logged and counted and the loop goes on; a step that raises is logged,
counted and retried after a short back-off. A bad sequence inside a batch is
the core's to isolate (edge/runtime/isolated_step.py), so it never stops the
batch. Busy (stepping) and idle (waiting) time are measured here, alike for
every role.
"""
from __future__ import annotations

import logging
import threading
import time
from collections import deque
from typing import Callable, Dict, Optional

from edge.runtime.core import EngineCore
log = logging.getLogger(__name__)


class LoopStats:
    """Turns, steps, busy and idle seconds, and errors by where they happened."""

    def __init__(self) -> None:
        self.turns = 0
        self.steps = 0
        self.busy_s = 0.0
        self.idle_s = 0.0
        self.errors: Dict[str, int] = {}

    def error(self, where: str) -> None:
        self.errors[where] = self.errors.get(where, 0) + 1

    def snapshot(self) -> dict:
        total = self.busy_s + self.idle_s
        return {"turns": self.turns, "steps": self.steps, "busy_s": self.busy_s, "idle_s": self.idle_s,
                "busy_ratio": self.busy_s / total if total > 0 else 0.0, "errors": dict(self.errors)}


class EngineLoop:
    """Runs `core` on its own thread (`start`/`stop`), or turn by turn (`run_once`) in tests."""

    def __init__(self, core: EngineCore, name: str, *, handle: Optional[Callable[[object], None]] = None,
                 publish: Optional[Callable[[object], None]] = None,
                 tick: Optional[Callable[[float], None]] = None, idle_wait: float = 0.25,
                 on_idle: Optional[Callable[[float], None]] = None, error_backoff: float = 0.1,
                 clock: Callable[[], float] = time.monotonic):
        self.core, self.name = core, name
        self._handle = handle or (lambda item: None)
        self._publish = publish or (lambda out: None)
        self._tick = tick
        self._on_idle = on_idle
        self.idle_wait, self.error_backoff = idle_wait, error_backoff
        self.clock = clock
        self.stats = LoopStats()
        self.stepping_since: Optional[float] = None   # when the step now running began (None: not in one)
        self._inbox: deque = deque()
        self._cv = threading.Condition()
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    # ---- from any thread ----
    def put(self, item) -> None:
        """Queue an input for `handle`, which runs in the loop's thread."""
        with self._cv:
            self._inbox.append(item)
            self._cv.notify()

    def backlog(self) -> int:
        """Inputs queued and not yet handled."""
        return len(self._inbox)

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self) -> "EngineLoop":
        if self._thread is None:
            self._stop.clear()
            self._thread = threading.Thread(target=self.serve_forever, name=self.name, daemon=True)
            self._thread.start()
        return self

    def stop(self, timeout: float = 10.0) -> None:
        """Stop after the current turn (inputs still queued are dropped)."""
        self._stop.set()
        with self._cv:
            self._cv.notify_all()
        t = self._thread
        if t is not None and t is not threading.current_thread():
            t.join(timeout)
        self._thread = None

    # ---- the loop ----
    def serve_forever(self) -> None:
        while not self._stop.is_set():
            if not self.run_once():
                self._idle()

    def run_once(self) -> bool:
        """One turn: inputs, tick, one step and its outputs. False when there was nothing to do."""
        self.stats.turns += 1
        did = self._drain()
        if self._tick is not None:
            self._guard("tick", self._tick, self.clock())
        if not self._guard("has_work", self.core.has_work):
            return did
        t0 = self.stepping_since = self.clock()
        try:
            outputs = self.core.step()
        except Exception:
            log.exception("%s: step failed", self.name)
            self.stats.error("step")
            self.stats.busy_s += self.clock() - t0
            self.stepping_since = None
            self._stop.wait(self.error_backoff)      # a persistent fault must not spin the CPU
            return True
        self.stepping_since = None
        self.stats.busy_s += self.clock() - t0
        self.stats.steps += 1
        for out in outputs or ():
            self._guard("publish", self._publish, out)
        return True

    def _drain(self) -> bool:
        with self._cv:
            items = list(self._inbox)
            self._inbox.clear()
        for item in items:
            self._guard("input", self._handle, item)
        return bool(items)

    def _idle(self) -> None:
        with self._cv:
            if self._inbox or self._stop.is_set():
                return
            t0 = self.clock()
            self._cv.wait(self._sleep())
            waited = self.clock() - t0
        self.stats.idle_s += waited
        if self._on_idle is not None:
            self._guard("idle", self._on_idle, waited)

    def _sleep(self) -> float:
        """idle_wait, or less where the core wants a step sooner (a held batch falls due)."""
        wake = getattr(self.core, "wake_in", None)       # optional: HeldBatchCore
        due = self._guard("wake_in", wake) if wake is not None else None
        return self.idle_wait if due is None else max(0.0, min(self.idle_wait, due))

    def _guard(self, where: str, fn, *args):
        """fn(*args), or None after logging and counting what it raised."""
        try:
            return fn(*args)
        except Exception:
            log.exception("%s: %s failed", self.name, where)
            self.stats.error(where)
            return None
