"""When the reverse star's verify service waits a moment so that the devices' verifies join (#46).

A work-conserving hub takes whatever is pending the moment it is free. N devices answered by one
call send their next drafts a few milliseconds apart (each drafts γ tokens, then the network), so
the hub starts on the first to arrive alone and the others wait for it: measured at N = 4 on the
F16 1.5B hub, mostly ONE session a verify call (14 x 461 ms, 4 x 986 ms with 3, 2 x 1036 ms with 4),
the devices out of step for good, and the batch that makes a verified token cheap never formed.

So, as the target's BatchedCalls do for generation threads (edge/engines/batched_calls.py: a round
waits for every joined generation, at most about one round's time), the verify service holds what
is pending while a session it answered is due back (its smoothed return time: drafting plus the
round trip, batch_hold.py's bookkeeping; while not yet known, the other sessions' mean) or a
session that just joined has not sent its first request yet; it serves as soon as they are in, or a little after they were due. The hold lasts at
most one verify call's time (the last call's seconds, `min_hold_s`..`max_hold_s`; `max_hold_s`
before any call), counted from the moment something was pending: a lone session never waits longer,
one that does not come back is not waited for again, and the devices, answered together, stay in
step by themselves.

Pure: fed with times, reads no clock (edge/star/verify_service.py feeds it; server/reverse_schedule.py
runs the same rule in the planner's model).
"""
from __future__ import annotations

from typing import Collection, Dict, Optional

from edge.star.batch_hold import LATE_SLACK, BatchHold

MAX_HOLD_S = 1.0         # the longest hold (and the bound before any call was timed)
MIN_HOLD_S = 0.002


class VerifyJoin(BatchHold):
    def __init__(self, max_hold_s: float = MAX_HOLD_S, min_hold_s: float = MIN_HOLD_S):
        if not 0.0 < min_hold_s <= max_hold_s:
            raise ValueError(f"need 0 < min_hold_s <= max_hold_s, got {min_hold_s!r}, {max_hold_s!r}")
        super().__init__(share=1.0, max_hold_s=max_hold_s)
        self.min_hold_s = min_hold_s
        self.call_s: Optional[float] = None      # the last verify call's seconds
        self._new: Dict[str, float] = {}         # sid -> when it joined (no request of it seen yet)

    def opened(self, sid: str, t: float) -> None:
        self._new[sid] = t

    def arrived(self, sid: str, t: float) -> None:
        self._new.pop(sid, None)
        super().arrived(sid, t)

    def forget(self, sid: str) -> None:
        self._new.pop(sid, None)
        super().forget(sid)

    def call(self, size: int, seconds: float, now: float) -> None:
        """A verify call over `size` sessions took `seconds` (its prompts' prefills not counted)."""
        if size > 0 and seconds > 0:
            self.call_s = seconds
        self.batch(size, seconds, now)

    def bound_s(self) -> Optional[float]:
        if self.call_s is None:
            return self.max_hold_s
        return min(max(self.call_s, self.min_hold_s), self.max_hold_s)

    def _wait_to(self, now: float, limit: float, pending: Collection[str]) -> Optional[float]:
        wait_to = super()._wait_to(now, limit, pending)
        known = list(self._back.values())
        guess = sum(known) / len(known) if known else None   # the others' return time
        gives = [min(limit, t + self.bound_s()) for sid, t in self._new.items() if sid not in pending]
        for sid, t0 in self._out.items():                     # answered once: its return time not yet known
            if sid in self._back or sid in pending:
                continue
            if guess is None:
                gives.append(min(limit, t0 + self.bound_s()))
            elif t0 + guess <= limit:
                gives.append(min(limit, t0 + (1 + LATE_SLACK) * guess))
        for give_up in gives:
            if give_up > now:
                wait_to = give_up if wait_to is None else max(wait_to, give_up)
        return wait_to
