"""The workers a SUN router chose for its recent requests, so that a client's copy of a request
is delivered again to them instead of being routed a second time.

A SunClient that hears nothing of a request for a while sends the same request again (same id,
same secret: edge/sun/client.py says why). The router that routed it drops the copy as a
replay -- a second routing would prefill and decode the request twice -- but the copy also
says the client still waits, and a PrefillJob or DecodeAssign may have been lost on its way (a
worker's link that moved to another broker node loses what was published to it meanwhile). So
the router sends the same job and assignment again to the same workers while it still counts
them as holding the request; each worker drops what it has already (its own replay memory) and
takes what it lacks: a re-sent assignment claims the KV the decoder held early. At most once per
`every` seconds per request, so a flood of copies costs the workers at most that, and only for a
copy with the request's own secret (only its client has it).
"""
from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Optional, Tuple

REDELIVER_S = 1.0              # at most one re-delivery per request this often
ROUTES_MAX = 4096              # requests remembered (the oldest forgotten first)


@dataclass
class Route:
    secret: bytes
    prefill: str
    decoder: str
    sent: float                # when its job and assignment last went out


class RecentRoutes:
    def __init__(self, size: int = ROUTES_MAX, every: float = REDELIVER_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.size, self.every, self.clock = size, every, clock
        self._routes: "OrderedDict[Tuple[str, str], Route]" = OrderedDict()

    def add(self, key: Tuple[str, str], secret: bytes, prefill: str, decoder: str) -> None:
        self._routes[key] = Route(secret, prefill, decoder, self.clock())
        while len(self._routes) > self.size:
            self._routes.popitem(last=False)

    def get(self, key: Tuple[str, str], secret: bytes) -> Optional[Route]:
        """The route of a request sent again with its own secret (None: unknown, or another secret)."""
        r = self._routes.get(key)
        return r if r is not None and r.secret == secret else None

    def due(self, r: Route) -> bool:
        """Whether its job and assignment may go out again now (then counted as sent)."""
        now = self.clock()
        if now - r.sent < self.every:
            return False
        r.sent = now
        return True

    def forget(self, key: Tuple[str, str]) -> None:
        self._routes.pop(key, None)
