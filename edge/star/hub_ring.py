"""Which hub of several serves a client, and which hubs are live (issue 38, point 3).

`owner(client, hubs)` is rendezvous (highest-random-weight) hashing: every hub gets a weight
sha256(hub, client) and the heaviest live hub owns the client. Every party (the device, each
hub) computes it from the same hub list and the hubs' own announcements, so nobody
coordinates; a hub that dies moves only its own clients (each to its next-heaviest hub), and a
hub that returns takes back only the clients whose heaviest hub it is -- no storm, no reshuffle
of anybody else. The hub list is configured on every party (`--hub-ids a,b`): the candidates
must be the same everywhere for the owners to agree, and exact topics (ss/hubs/{hub}) get their
retained announcement even on brokers that deliver none through wildcards (RabbitMQ).

`HubView` is one party's view of the hubs: a hub is live while its last announcement
(HubStatus on ss/hubs/{hub}, retained, re-sent every few seconds, its last will says offline)
says online and came within `silent_after` s. Its `time` is the hub's epoch (start time): a
new epoch means a restarted hub whose sessions are gone. Thread-safe.
"""
from __future__ import annotations

import hashlib
import threading
import time
from dataclasses import dataclass
from typing import Callable, Dict, Iterable, List, Optional

from edge.wire.field_types import ProtocolError, check_id

HUB_SILENT_S = 5.0           # hubs announce every ~2 s: two missed announcements and some slack


def weight(hub: str, client: str) -> int:
    """The hub's random weight for this client: the same on every machine and every run."""
    digest = hashlib.sha256(f"{hub}\0{client}".encode()).digest()
    return int.from_bytes(digest[:8], "big")


def owner(client: str, hubs: Iterable[str]) -> Optional[str]:
    """The hub that serves `client` among `hubs` (None when there is none)."""
    return max(hubs, key=lambda h: (weight(h, client), h), default=None)


def parse_hub_list(hubs) -> List[str]:
    """Hub ids from "a,b" or ["a", "b"], each checked, in the given order; a clear error otherwise."""
    items = hubs.split(",") if isinstance(hubs, str) else list(hubs)
    out: List[str] = []
    for h in (str(x).strip() for x in items):
        if not h:
            continue
        try:
            check_id(h, "hub id")
        except ProtocolError as e:
            raise ValueError(f"bad hub list {hubs!r}: {e} (give hub ids separated by commas, "
                             f"each 1-64 of A-Z a-z 0-9 _ . -)") from None
        if h in out:
            raise ValueError(f"hub {h!r} is named twice in the hub list {hubs!r}")
        out.append(h)
    return out


@dataclass
class _Heard:
    online: bool = False
    epoch: float = 0.0
    seen: float = 0.0
    serves: bool = True         # its announcement lists a draft service it can assign


class HubView:
    """The live hubs among a configured list, from their announcements."""

    def __init__(self, hubs: Iterable[str], silent_after: float = HUB_SILENT_S,
                 clock: Callable[[], float] = time.monotonic):
        self.hubs = parse_hub_list(hubs)
        if not self.hubs:
            raise ValueError("a hub view needs at least one hub id")
        if silent_after <= 0:
            raise ValueError(f"silent_after must be positive seconds, got {silent_after}")
        self.silent_after, self.clock = silent_after, clock
        self._h: Dict[str, _Heard] = {h: _Heard() for h in self.hubs}
        self._lock = threading.Lock()
        self.deaths = {"will": 0, "silent": 0, "restart": 0}

    def heard(self, hub: str, online: bool, epoch: float, serves: bool = True) -> bool:
        """An announcement of `hub`; True when it changes what that hub's sessions are worth
        (the hub went offline, came up, or restarted with a new epoch). Unknown hubs are ignored."""
        with self._lock:
            h = self._h.get(hub)
            if h is None:
                return False
            was = (h.online, h.epoch if h.online else None)
            h.seen, h.serves = self.clock(), serves
            if online:
                if h.online and h.epoch != epoch:
                    self.deaths["restart"] += 1
                h.online, h.epoch = True, epoch
            else:
                if h.online:
                    self.deaths["will"] += 1
                h.online = False
            return was != (h.online, h.epoch if h.online else None)

    def sweep(self) -> List[str]:
        """Hubs silent past `silent_after` since the last sweep: now offline (their sessions are lost)."""
        now = self.clock()
        out = []
        with self._lock:
            for name, h in self._h.items():
                if h.online and now - h.seen > self.silent_after:
                    h.online = False
                    self.deaths["silent"] += 1
                    out.append(name)
        return out

    def live(self) -> List[str]:
        now = self.clock()
        with self._lock:
            return [n for n, h in self._h.items() if h.online and now - h.seen <= self.silent_after]

    def epoch(self, hub: str) -> Optional[float]:
        """The live hub's epoch, None when it is not live."""
        return self._h[hub].epoch if hub in self.live() else None

    def owner(self, client: str) -> Optional[str]:
        """The owner among the live hubs that can draft now (a hub just back has not yet proven its
        draft services: its clients come back once it has), or among all live ones if none can."""
        live = self.live()
        with self._lock:
            ready = [h for h in live if self._h[h].serves]
        return owner(client, ready or live)

    def snapshot(self) -> dict:
        now = self.clock()
        with self._lock:
            return {"deaths": dict(self.deaths),
                    "hubs": {n: {"online": h.online, "epoch": h.epoch,
                                 "age_s": round(now - h.seen, 3) if h.seen else None}
                             for n, h in self._h.items()}}
