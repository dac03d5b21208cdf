"""The sessions a client ended that its hub may not have heard of yet, for its next joins to name.

A bye goes to the session's draft service, which tells the hub (SessionRelease, or its own callback)
only once its loop handled it, after the step it is in. A client's next join goes to the hub
directly and, on a busy service, arrives first: the hub would count the ended session and refuse a
target that runs --parallel N at its client limit of N (#44). So every join names the sessions its
client ended (Join.ended) and the hub releases them before it counts (server/join_ended.py).

A session is named until a join that named it is answered (the hub read the list before its answer),
the newest MAX_ENDED at most, each only to the hub that assigned it (several hubs).
"""
from __future__ import annotations

import threading
from collections import OrderedDict

from edge.wire.protocol import MAX_ENDED


class EndedSessions:
    def __init__(self, limit: int = MAX_ENDED) -> None:
        self.limit = limit
        self._ended: "OrderedDict[str, str]" = OrderedDict()     # sid -> the hub that assigned it
        self._lock = threading.Lock()

    def ended(self, sid: str, home: str = "") -> None:
        """The client said bye to `sid` (assigned by hub `home`; "": the one hub)."""
        with self._lock:
            self._ended[sid] = home
            self._ended.move_to_end(sid)
            while len(self._ended) > self.limit:
                self._ended.popitem(last=False)

    def for_join(self, hub: str = "") -> list:
        """The sids a join to `hub` names: the newest, oldest first."""
        with self._lock:
            return [sid for sid, home in self._ended.items() if home == hub][-self.limit:]

    def answered(self, sids) -> None:
        """A join that named `sids` was answered: the hub released them; no later join needs to."""
        with self._lock:
            for sid in sids:
                self._ended.pop(sid, None)
