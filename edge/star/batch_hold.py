"""When a draft service should wait a moment for sessions about to come back (batch coalescing).

After a batch, each served session's target verifies and sends its next request some r_i
later (its *return time*: verify + the network both ways). A request that arrives while a
batch runs waits for it and is then served at once; the sessions of the batch that just
ended come back while that one runs, wait in turn, and are served on their own. So on a
busy draft the sessions split into groups that take turns, each batch about N/2 of them
(measured: 4 emulated Jetson targets, one 0.5B draft on one core, mean batch 2.0), and a
round costs every target D(p) + D(m) of draft time instead of one D(p + m).

With the batch time affine in its size, D(b) = a + c·b, serving the groups together saves
the fixed part `a` once, and waiting w for the returning group costs w of draft time. So
the service holds the pending requests while the sessions it waits for are due within
`share`·a of the moment it started holding, and serves as soon as they are all in (or a
little after they were due: a session that does not come back is not waited for again
until it does). `a` is the intercept of a line through the batch times by size (a smoothed
mean per size, kept for every size seen, so a service that merges its batches still knows
what a smaller one cost); with one size seen only, a = D(b)/(b + 1), as if the fixed part
were one request's share: a first hold then shows what a larger batch costs. Nothing
pending, nothing due soon, or no fixed cost: no hold, the service stays work-conserving.

share = 0.5 by default: hold only where the saving is twice the wait. On one CPU core the
fitted `a` of the same Q4_0 draft came out 25 to 63 ms from run to run against targets
back in 35 ms, and there the holds that went ahead cost 4-11% of system tok/s
(benchmarks/results/draft_switch/batch_hold_q4_0.md); a memory-bound draft saves far more than it waits.

Pure: fed with times, reads no clock (edge/star/draft_service.py's DraftService feeds it).
"""
from __future__ import annotations

from typing import Collection, Dict, Optional

RETURN_EWMA = 0.3        # weight of the newest return-time sample
COST_EWMA = 0.2          # ... and of the newest batch time of its size
LATE_SLACK = 0.25        # wait this share of a session's return time past when it was due


class BatchHold:
    def __init__(self, share: float = 0.5, max_hold_s: float = 0.5):
        if not 0.0 <= share <= 1.0:
            raise ValueError(f"share must be in [0, 1] (of the batch's fixed cost), got {share!r}")
        self.share, self.max_hold_s = share, max_hold_s
        self._back: Dict[str, float] = {}        # sid -> smoothed return time
        self._out: Dict[str, float] = {}         # sid -> when its answer left (the target has it)
        self._cost: Dict[int, float] = {}        # batch size -> smoothed seconds
        self._since: Optional[float] = None      # when the current hold began
        self.holds = 0                           # holds begun
        self.held_s = 0.0                        # seconds spent holding

    # ---- what the service reports ----
    def answered(self, sid: str, t: float) -> None:
        self._out[sid] = t

    def arrived(self, sid: str, t: float) -> None:
        """A request of `sid` arrived at t: a return-time sample if an answer of ours was out."""
        t0 = self._out.pop(sid, None)
        if t0 is None or t < t0:
            return
        old, r = self._back.get(sid), t - t0
        if old is None:
            self._back[sid] = r
        elif r <= 4 * old:                       # longer: the target paused (a new prompt), not a round
            self._back[sid] = (1 - RETURN_EWMA) * old + RETURN_EWMA * r

    def forget(self, sid: str) -> None:
        self._out.pop(sid, None)
        self._back.pop(sid, None)

    def batch(self, size: int, seconds: float, now: float) -> None:
        """A batch of `size` requests took `seconds` (batches with a prompt's prefill: not given)."""
        if size > 0 and seconds > 0:
            old = self._cost.get(size)
            self._cost[size] = seconds if old is None else (1 - COST_EWMA) * old + COST_EWMA * seconds
        self.end(now)

    def end(self, now: float) -> None:
        """The pending requests were served: the hold, if any, is over."""
        if self._since is not None:
            self.held_s += max(0.0, now - self._since)
            self._since = None

    # ---- the decision ----
    def fixed_cost(self) -> Optional[float]:
        """`a` of D(b) = a + c·b fitted to the batch times by size, None before any batch."""
        pts = list(self._cost.items())
        if not pts:
            return None
        n = len(pts)
        mb, mt = sum(b for b, _ in pts) / n, sum(t for _, t in pts) / n
        if n == 1:
            return mt / (mb + 1)
        c = sum((b - mb) * (t - mt) for b, t in pts) / sum((b - mb) ** 2 for b, _ in pts)
        return min(mt, max(0.0, mt - c * mb))

    def bound_s(self) -> Optional[float]:
        """The longest a hold may last: `share` of the fixed cost, at most max_hold_s (None: no hold)."""
        a = self.fixed_cost()
        return min(self.share * a, self.max_hold_s) if a else None

    def until(self, now: float, pending: Collection[str]) -> Optional[float]:
        """When to serve `pending` (sids with a request queued): None = now, else a later time."""
        if not pending:
            return None
        bound = self.bound_s()
        if not bound:
            return None
        start = now if self._since is None else self._since
        wait_to = self._wait_to(now, start + bound, pending)
        if wait_to is None:
            self.end(now)
            return None
        if self._since is None:
            self._since, self.holds = now, self.holds + 1
        return wait_to

    def _wait_to(self, now: float, limit: float, pending: Collection[str]) -> Optional[float]:
        """The latest moment worth waiting to (at most `limit`) for the sessions due back, None if none."""
        wait_to = None
        for sid, t0 in self._out.items():
            r = self._back.get(sid)
            if r is None or sid in pending:
                continue
            due = t0 + r
            if due <= limit:
                give_up = min(limit, due + LATE_SLACK * r)
                if give_up > now:
                    wait_to = give_up if wait_to is None else max(wait_to, give_up)
        return wait_to
