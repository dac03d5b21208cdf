"""Hellos while a node's loop is inside one long step.

A node's hello goes out from its loop's thread, between steps. One step can be long: a prefill
worker's step prefills up to 8 prompts one after another (seconds each on a small CPU core, tens
of seconds on a loaded one). The hub's liveness (server/liveness.py) declares a node dead after 5 s
without a hello once it sent it work, and after 10 s without any: a burst of long prompts made a
healthy prefill worker "dead", its requests failed as worker_lost and were refused as unknown_task
(benchmarks/sun/sun_vs_multilora.py, 2 shared cores). So while a step runs longer than the hello
period, this thread sends the node's hello itself, every period, for at most `max_step_s`: a step
still running after that is taken for a hang, and the node falls silent so the hub gives its work
to others as before.
"""
from __future__ import annotations

import logging
import threading

log = logging.getLogger(__name__)

MAX_STEP_S = 300.0        # a step longer than this is a hang: no more hellos for it


class StepHeartbeat:
    """Every `every` s: while `loop.stepping_since` is at least `every` and at most `max_step_s`
    old, call `say()` (which publishes the node's hello; it must be safe off the loop's thread)."""

    def __init__(self, loop, say, every: float, max_step_s: float = MAX_STEP_S, name: str = "heartbeat"):
        self.loop, self.say, self.every, self.max_step_s = loop, say, every, max_step_s
        self.sent = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> "StepHeartbeat":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(5)

    def beat(self) -> bool:
        """One check: say the hello if a step has run between `every` and `max_step_s`."""
        since = self.loop.stepping_since
        if since is None or not self.every <= self.loop.clock() - since <= self.max_step_s:
            return False
        try:
            self.say()
        except Exception:                        # the loop's thread may be changing what the hello reads
            log.debug("heartbeat hello not sent", exc_info=True)
            return False
        self.sent += 1
        return True

    def _run(self) -> None:
        while not self._stop.wait(self.every):
            self.beat()
