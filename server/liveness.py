"""Who is alive among the services that announce themselves with retained hellos.

A retained hello outlives its publisher when the process dies without its
last will reaching the broker (a hung process, a will lost with a broker that
kept the retained message, a test that stops a node without its goodbye), so
the hub's registry and the SUN router trust a service only once it is proven
alive, and stop trusting it when it goes quiet:

* proven: a hello that arrives after we probed the service (`Probe` on its ctl
  topic, which every node answers with a fresh hello). The first hello we hear
  of a service -- possibly the retained copy of a dead one -- asks for a probe.
* dead: its will (an offline hello), no hello for `stale_after` s (nodes send
  one at least every ~2 s), or work sent to it that it did not acknowledge
  with a hello within `answer_within` s (an assignment changes what its hello
  says, so a live service answers one at once).

The caller owns the I/O: `heard()` says when to send a probe, `sweep()` names
the services that just died (fail their requests, release their sessions).
Thread-safe: hellos arrive on the link's thread, sweeps on a timer.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional

STALE_AFTER_S = 10.0           # a node's periodic hello comes every 2-4 s: three missed ones
ANSWER_WITHIN_S = 5.0          # a probe or an assignment unanswered this long: not alive


@dataclass
class _State:
    online: bool = False       # alive and not yet found dead
    proven: bool = False       # answered a probe since it (re)appeared
    probed: float = 0.0        # when we last probed it (0: not since it appeared)
    seen: float = 0.0          # last hello
    owed: float = 0.0          # oldest unacknowledged work sent to it (0: none)
    local: bool = False        # in this process: alive while we are


class Liveness:
    def __init__(self, stale_after: float = STALE_AFTER_S, answer_within: float = ANSWER_WITHIN_S,
                 clock: Callable[[], float] = time.monotonic):
        if stale_after <= 0 or answer_within <= 0:
            raise ValueError("stale_after and answer_within must be positive seconds")
        self.stale_after, self.answer_within, self.clock = stale_after, answer_within, clock
        self._s: Dict[str, _State] = {}
        self._lock = threading.Lock()
        self.deaths: Dict[str, int] = {"will": 0, "silent": 0, "unanswered": 0}

    def heard(self, name: str, online: bool, local: bool = False) -> bool:
        """A hello from `name`; True when the caller should probe it now."""
        now = self.clock()
        with self._lock:
            s = self._s.setdefault(name, _State())
            s.seen, s.owed, s.local = now, 0.0, local
            if not online:                                   # its will or its goodbye
                if s.online or s.proven:
                    self.deaths["will"] += 1
                s.online = s.proven = False
                s.probed = 0.0
                return False
            if local or (s.probed and not s.proven):         # answered our probe: alive
                s.proven = True
            s.online = s.proven
            if s.proven or (s.probed and now - s.probed < self.answer_within):
                return False
            s.probed = now
            return True

    def owe(self, name: str) -> None:
        """We sent `name` work its next hello must acknowledge."""
        with self._lock:
            s = self._s.get(name)
            if s is not None and not s.local and not s.owed:
                s.owed = self.clock()

    def alive(self, name: str) -> bool:
        now = self.clock()
        with self._lock:
            s = self._s.get(name)
            return s is not None and s.online and (s.local or not self._dead(s, now))

    def forget_probes(self) -> None:
        """Our link reconnected: retained hellos come again, and prove nothing."""
        with self._lock:
            for s in self._s.values():
                if not s.proven:
                    s.probed = 0.0

    def forget(self, name: str) -> None:
        with self._lock:
            self._s.pop(name, None)

    def sweep(self) -> List[str]:
        """The services found dead since the last sweep (silent or unanswered); they stay dead
        until they answer a probe again."""
        now = self.clock()
        out = []
        with self._lock:
            for name, s in self._s.items():
                why = None if s.local or not s.online else self._dead(s, now)
                if why:
                    s.online = s.proven = False
                    s.probed = 0.0
                    self.deaths[why] += 1
                    out.append(name)
        return out

    def _dead(self, s: _State, now: float) -> Optional[str]:
        if now - s.seen > self.stale_after:
            return "silent"
        if s.owed and now - s.owed > self.answer_within:
            return "unanswered"
        return None

    def snapshot(self) -> dict:
        now = self.clock()
        with self._lock:
            return {"deaths": dict(self.deaths),
                    "services": {n: {"alive": s.online, "proven": s.proven, "age_s": round(now - s.seen, 3)}
                                 for n, s in self._s.items()}}
