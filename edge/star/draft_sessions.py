"""What every draft core shares: the session table, the queue of requests (Q_in), the replies
the next step returns, eviction of silent sessions, and the checks of a request's fields.

DraftService (a model) and SuffixDraftService (suffix trees) subclass it; each makes its own
session objects (`_new_session`) with at least `sid`, `last_seq`, `last_seen` and `closed`,
and frees what a closed one holds (`_release`). open/close/submit may be called from any
thread; the step that takes the pending requests runs on one loop (edge/runtime/loop.py).
"""
from __future__ import annotations

import threading
from typing import Callable, Dict, List, Optional, Tuple

from edge.wire.protocol import E_BAD_KEEP, E_BAD_REQUEST, E_UNKNOWN_SESSION, DraftRequest, Error
from edge.star.draft_limits import DraftLimits, DraftRefused
from edge.star.draft_stats import DraftStats


class DraftSessions:
    counts_sessions = True                # False where a wrapped core counts them (the hybrid)
    full_hint = "add a draft service (`edge-agent run --role draft`) or raise --max-sessions"

    def __init__(self, limits: DraftLimits, clock: Callable[[], float], name: str, vocab_size: int):
        self.limits, self.clock, self.name = limits, clock, name
        self.vocab_size = int(vocab_size)
        self.stats = DraftStats(clock)
        self._sessions: Dict[str, object] = {}
        self._pending: Dict[str, Tuple[DraftRequest, float]] = {}
        self._outbox: List[Tuple[str, object]] = []   # replies the next step returns
        self._lock = threading.RLock()

    # ---- what a core defines ----
    def _new_session(self, sid: str):
        raise NotImplementedError

    def _check_open(self) -> None:
        """Refusals beyond the session count (the model draft's KV memory)."""

    def _release(self, s) -> None:
        """Free what a closed session holds."""

    # ---- sessions ----
    def open(self, sid: str) -> None:
        with self._lock:
            if sid in self._sessions:
                return
            if len(self._sessions) >= self.limits.max_sessions:
                self.stats.count("refused_sessions")
                raise DraftRefused(f"draft service {self.name!r} already serves its limit of "
                                   f"{self.limits.max_sessions} sessions; {self.full_hint}")
            self._check_open()
            self._sessions[sid] = self._new_session(sid)
            if self.counts_sessions:
                self.stats.count("opened")

    def close(self, sid: str, reason: str = "bye") -> bool:
        """Drop a session and what it holds. False if unknown."""
        with self._lock:
            s = self._sessions.pop(sid, None)
            self._pending.pop(sid, None)
            if s is None:
                return False
            s.closed = True                        # a batch in flight skips it from now on
            self._release(s)
            if self.counts_sessions:
                self.stats.count(f"closed_{reason}")
        return True

    def sessions(self) -> List[str]:
        with self._lock:
            return list(self._sessions)

    def evict_silent(self, now: Optional[float] = None) -> List[str]:
        """Close the sessions silent for longer than limits.evict_after_s; returns their ids."""
        now = self.clock() if now is None else now
        with self._lock:
            old = [sid for sid, s in self._sessions.items()
                   if now - s.last_seen > self.limits.evict_after_s and sid not in self._pending]
        return [sid for sid in old if self.close(sid, "timeout")]

    # ---- Q_in ----
    def submit(self, req: DraftRequest, received: Optional[float] = None) -> None:
        """Queue a request; replaces an older pending one of the same session. `received`: when
        the network delivered it (the loop submits between batches), for the batch hold."""
        with self._lock:
            s = self._sessions.get(req.sid)
            if s is None:
                self.stats.count("unknown_session")
                self._reply(req.sid, Error(req.sid, req.seq, E_UNKNOWN_SESSION,
                                           "this draft service has no such session (evicted or "
                                           "restarted): join the hub again"))
                return
            old = self._pending.get(req.sid)
            if req.seq <= s.last_seq or (old and req.seq <= old[0].seq):
                self.stats.count("stale")
                return
            if old:
                self.stats.count("replaced")
            s.last_seen = self.clock()
            self._pending[req.sid] = (req, s.last_seen)
            self._arrived(req.sid, s.last_seen if received is None else received)

    def _arrived(self, sid: str, t: float) -> None:
        """A request of `sid` was queued; it reached this node at t (under the lock)."""

    def pending(self) -> int:
        with self._lock:
            return len(self._pending)

    def _reply(self, sid: str, msg) -> None:
        with self._lock:
            self._outbox.append((sid, msg))

    def _take(self, busy=frozenset()) -> list:
        """Everything pending, as (session, request, arrival), live sessions only; the requests
        of sessions in `busy` (a request of theirs still being served) stay pending."""
        with self._lock:
            taken = [(self._sessions.get(sid), *self._pending.pop(sid))
                     for sid in list(self._pending) if sid not in busy]
        return [(s, r, t) for s, r, t in taken if s is not None and not s.closed]

    def _replies(self) -> List[Tuple[str, object]]:
        with self._lock:
            out, self._outbox = self._outbox, []
        return out

    def _check_request(self, s, req: DraftRequest, held: int) -> None:
        """A request's fields against what the session holds and the limits; DraftRefused if bad."""
        s.last_seq = req.seq
        if req.keep > held:
            self.stats.count("bad_keep")
            raise DraftRefused(f"keep={req.keep} but this draft holds only {held} tokens of the "
                               f"session: resend with keep <= {held}", E_BAD_KEEP)
        if req.keep + len(req.append) == 0:
            raise DraftRefused("nothing to draft after: keep=0 and an empty append", E_BAD_REQUEST)
        if req.gamma > self.limits.max_gamma:
            self.stats.count("bad_gamma")
            raise DraftRefused(f"gamma={req.gamma} exceeds this draft service's limit of "
                               f"{self.limits.max_gamma}", E_BAD_REQUEST)
        if any(t >= self.vocab_size for t in req.append):
            self.stats.count("bad_token")
            raise DraftRefused(f"append holds a token id >= the draft's vocabulary of {self.vocab_size}",
                               E_BAD_REQUEST)
