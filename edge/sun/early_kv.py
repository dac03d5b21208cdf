"""The SUN decoder's hold for KV that overtook its assignment, bound to who sent it.

Such KV cannot be verified yet (the request's secret comes with the assignment), so anyone who
may publish to the decoder's KV topic could fill a shared hold with chunks for requests that do
not exist and crowd out the early KV of a real one. So every hold is per sender: the sender is
the last level of the KV topic (ss/sun/w/{decoder}/kv/{sender}), which the broker's ACL lets a
SUN worker write only under its own name. Each sender has a quota of its own (bytes, requests),
so a flood fills only its sender's. Senders the router has named as a request's prefill worker
(`vouch`, from the assignments) always get one; the others (a new prefill worker's first early
KV, or an intruder) only while fewer than MAX_STRANGERS of them hold KV. All together stay
within `total_bytes`: disturbing one sender's early KV takes several flooding identities. An
assignment claims only the KV of the prefill worker it names; the rest for that request is
dropped. Without the ACL the topic's sender is whatever the publisher writes: no identity.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Dict, List, Tuple

MAX_STRANGERS = 3              # senders no assignment named that may hold KV at once
MAX_VOUCHED = 256              # prefill workers remembered (least recently named forgotten)
MAX_RIDS = 1024                # requests one sender's quota holds


@dataclass
class _Quota:
    nbytes: int = 0
    rids: Dict[str, List[Tuple[bytes, float]]] = field(default_factory=dict)   # rid -> (payload, t)


class EarlyKV:
    """`hold` KV of unknown requests per sender quota; `claim` it when the assignment comes."""

    def __init__(self, quota_bytes: int, total_bytes: int) -> None:
        """quota_bytes: what one sender may have held; total_bytes: all senders together."""
        self.quota_bytes, self.total_bytes = quota_bytes, max(quota_bytes, total_bytes)
        self._vouched: "OrderedDict[str, None]" = OrderedDict()
        self._quotas: Dict[str, _Quota] = {}          # sender -> what it has held (never empty)
        self.nbytes = 0

    def vouch(self, sender: str) -> None:
        """The router named `sender` as a prefill worker: from now on it always gets a quota."""
        self._vouched[sender] = None
        self._vouched.move_to_end(sender)
        while len(self._vouched) > MAX_VOUCHED:
            self._vouched.popitem(last=False)

    def hold(self, sender: str, rid: str, payload: bytes, now: float) -> bool:
        """Keep `payload` for `rid` within its sender's quota; False: no room (drop it)."""
        q, n = self._quotas.get(sender), len(payload)
        if q is None and sender not in self._vouched and \
                sum(1 for k in self._quotas if k not in self._vouched) >= MAX_STRANGERS:
            return False
        used, rids = (q.nbytes, q.rids) if q is not None else (0, {})
        if used + n > self.quota_bytes or self.nbytes + n > self.total_bytes \
                or (rid not in rids and len(rids) >= MAX_RIDS):
            return False
        q = q or self._quotas.setdefault(sender, _Quota())
        q.rids.setdefault(rid, []).append((payload, now))
        q.nbytes += n
        self.nbytes += n
        return True

    def claim(self, rid: str, prefill: str) -> Tuple[List[bytes], int]:
        """(the payloads `prefill` sent for `rid`, how many other senders' were dropped for it)."""
        mine, others = [], 0
        for sender, q in list(self._quotas.items()):
            items = q.rids.pop(rid, ())
            for payload, _ in items:
                q.nbytes -= len(payload)
                self.nbytes -= len(payload)
            if sender == prefill:
                mine = [p for p, _ in items]
            else:
                others += len(items)
            if not q.rids:
                del self._quotas[sender]
        return mine, others

    def expire(self, now: float, timeout: float) -> int:
        """Drop what waited longer than `timeout`; returns how many payloads."""
        dropped = 0
        for sender, q in list(self._quotas.items()):
            for rid, items in list(q.rids.items()):
                kept = [x for x in items if now - x[1] <= timeout]
                for payload, t in items:
                    if now - t > timeout:
                        q.nbytes -= len(payload)
                        self.nbytes -= len(payload)
                        dropped += 1
                if kept:
                    q.rids[rid] = kept
                else:
                    del q.rids[rid]
            if not q.rids:
                del self._quotas[sender]
        return dropped

    # a read-only view by request id (tests and stats): rid -> held payloads, every sender's
    def get(self, rid: str, default=()) -> List[bytes]:
        got = [p for q in self._quotas.values() for p, _ in q.rids.get(rid, ())]
        return got if got else list(default)

    def __contains__(self, rid: str) -> bool:
        return any(rid in q.rids for q in self._quotas.values())

    def __getitem__(self, rid: str) -> List[bytes]:
        if rid not in self:
            raise KeyError(rid)
        return self.get(rid)

    def __len__(self) -> int:
        return len({rid for q in self._quotas.values() for rid in q.rids})
