"""A StarSD draft service with no model: suffix-tree proposals (edge/suffix_drafter.py).

The same core interface as DraftService (open/close/submit/step on edge/roles/loop.py,
behind a DraftNode), so the hub or a device serves it like the model draft. Per session
it keeps what the target assumes it holds -- T + drafts[:-1] after answering a request
for context T -- and a SuffixContext over T; all sessions share ONE global tree, fed
with the output tokens each DraftRequest appends, so every session of the star teaches
every other (a function name one target emitted is proposed to the next).

Drafting is a dictionary walk per token, microseconds, so a step serves everything
pending at once and a service takes far more sessions than a model draft could
(N_full of the system model grows by the ratio of the draft's step times).
Proposals are deterministic: under sampling each token's q is its point mass (sent as
one entry), so the target's verification stays exactly lossless.
"""
from __future__ import annotations

import threading
import time
from typing import Callable, Dict, List, Optional, Tuple

import numpy as np

from edge.protocol import (E_BAD_KEEP, E_BAD_REQUEST, E_UNKNOWN_SESSION, DraftRequest, DraftResponse, Error)
from edge.roles.draft_limits import DraftLimits, DraftRefused
from edge.roles.draft_stats import DraftStats
from edge.sampling import SamplingParams
from edge.suffix_drafter import SuffixConfig, SuffixContext
from edge.suffix_tree import SuffixTree


def _greedy(req: DraftRequest) -> bool:
    return SamplingParams.from_wire(req.sampling).greedy


class _Session:
    def __init__(self, sid: str, cfg: SuffixConfig, shared: SuffixTree, now: float):
        self.sid = sid
        self.ctx = SuffixContext(cfg, shared, key=sid)
        self.held: List[int] = []          # what the target assumes this service holds
        self.last_seq = -1
        self.last_seen = now
        self.closed = False


def point_mass_q(tokens: List[int]) -> list:
    """q of a deterministic proposal on the wire: one entry, probability 1, per token."""
    return [(np.array([t], dtype=np.int64), np.array([1.0])) for t in tokens]


class SuffixDraftService:
    """Open/close/submit from any thread; `step` (one loop) answers everything pending."""
    counts_sessions = True                # False where a wrapped core counts them (the hybrid)

    def __init__(self, vocab_size: int, limits: Optional[DraftLimits] = None,
                 cfg: Optional[SuffixConfig] = None, shared: Optional[SuffixTree] = None,
                 clock: Callable[[], float] = time.monotonic, name: str = "suffix", fingerprint: str = ""):
        self.vocab_size = int(vocab_size)
        self.limits = limits or DraftLimits()
        self.cfg = cfg or SuffixConfig()
        self.shared = shared if shared is not None else self.cfg.global_tree()
        self.clock, self.name, self.fingerprint = clock, name, fingerprint
        self.stats = DraftStats(clock)
        self._sessions: Dict[str, _Session] = {}
        self._pending: Dict[str, Tuple[DraftRequest, float]] = {}
        self._outbox: List[Tuple[str, object]] = []
        self._lock = threading.RLock()

    # ---- sessions ----
    def open(self, sid: str) -> None:
        with self._lock:
            if sid in self._sessions:
                return
            if len(self._sessions) >= self.limits.max_sessions:
                self.stats.count("refused_sessions")
                raise DraftRefused(f"draft service {self.name!r} already serves its limit of "
                                   f"{self.limits.max_sessions} sessions; raise --max-sessions (a suffix "
                                   "draft costs microseconds a request) or add a draft service")
            self._sessions[sid] = _Session(sid, self.cfg, self.shared, self.clock())
            if self.counts_sessions:
                self.stats.count("opened")

    def close(self, sid: str, reason: str = "bye") -> bool:
        """Drop a session (its outputs stay in the global tree). False if unknown."""
        with self._lock:
            s = self._sessions.pop(sid, None)
            self._pending.pop(sid, None)
            if s is None:
                return False
            s.closed = True
            s.ctx.close()
            if self.counts_sessions:
                self.stats.count(f"closed_{reason}")
        return True

    def sessions(self) -> List[str]:
        with self._lock:
            return list(self._sessions)

    def kv_tokens(self) -> int:
        """Tokens held for the sessions (their local trees' text)."""
        with self._lock:
            return sum(len(s.ctx.tokens) for s in self._sessions.values())

    def evict_silent(self, now: Optional[float] = None) -> List[str]:
        now = self.clock() if now is None else now
        with self._lock:
            old = [sid for sid, s in self._sessions.items()
                   if now - s.last_seen > self.limits.evict_after_s and sid not in self._pending]
        return [sid for sid in old if self.close(sid, "timeout")]

    # ---- Q_in ----
    def submit(self, req: DraftRequest) -> None:
        """Queue a request; replaces an older pending one of the same session."""
        with self._lock:
            s = self._sessions.get(req.sid)
            if s is None:
                self.stats.count("unknown_session")
                self._outbox.append((req.sid, Error(req.sid, req.seq, E_UNKNOWN_SESSION,
                                                    "this draft service has no such session (evicted or "
                                                    "restarted): join the hub again")))
                return
            old = self._pending.get(req.sid)
            if req.seq <= s.last_seq or (old and req.seq <= old[0].seq):
                self.stats.count("stale")
                return
            if old:
                self.stats.count("replaced")
            s.last_seen = self.clock()
            self._pending[req.sid] = (req, s.last_seen)

    def pending(self) -> int:
        with self._lock:
            return len(self._pending)

    def has_work(self) -> bool:
        with self._lock:
            return bool(self._outbox or self._pending)

    # ---- the core's step ----
    def step(self) -> List[Tuple[str, object]]:
        """Answer everything pending; returns the replies: (sid, DraftResponse | Error)."""
        taken = self._take()
        if taken:
            t0 = self.clock()
            for s, req, t_in in taken:
                try:
                    self._context(s, req)
                except DraftRefused as e:
                    self._outbox.append((s.sid, Error(s.sid, req.seq, e.code, e.reason)))
                    continue
                p = s.ctx.propose(req.gamma)
                self.stats.count(f"proposed_{s.ctx.source}" if p.tokens else "proposed_none")
                self.answer(s, req.seq, _greedy(req), s.ctx.tokens, p.tokens, t_in)
            self.stats.add_batch(len(taken), 0, self.clock() - t0)
        with self._lock:
            out, self._outbox = self._outbox, []
        return out

    def _take(self) -> list:
        with self._lock:
            taken = [(self._sessions.get(sid), req, t) for sid, (req, t) in self._pending.items()]
            self._pending.clear()
        return [(s, r, t) for s, r, t in taken if s is not None and not s.closed]

    def _context(self, s: _Session, req: DraftRequest) -> None:
        """Check the request and sync the session's trees to its context T = held[:keep] + append."""
        s.last_seq = req.seq
        if req.keep > len(s.held):
            self.stats.count("bad_keep")
            raise DraftRefused(f"keep={req.keep} but this draft holds only {len(s.held)} tokens of the "
                               f"session: resend with keep <= {len(s.held)}", E_BAD_KEEP)
        if req.keep + len(req.append) == 0:
            raise DraftRefused("nothing to draft after: keep=0 and an empty append", E_BAD_REQUEST)
        if req.gamma > self.limits.max_gamma:
            raise DraftRefused(f"gamma={req.gamma} exceeds this draft service's limit of "
                               f"{self.limits.max_gamma}", E_BAD_REQUEST)
        if any(t >= self.vocab_size for t in req.append):
            raise DraftRefused(f"append holds a token id >= the draft's vocabulary of {self.vocab_size}",
                               E_BAD_REQUEST)
        s.ctx.sync(s.held[:req.keep] + list(req.append), same=req.keep)

    def answer(self, s: _Session, seq: int, greedy: bool, context: List[int], tokens: List[int],
               t_in: float, q: Optional[list] = None) -> None:
        """Reply to request `seq` with `tokens` drafted after `context` (q: theirs; None: point
        masses under sampling); the target now assumes we hold context + tokens[:-1]."""
        now = self.clock()
        tokens = [int(t) for t in tokens]
        s.held = list(context) + tokens[:-1]
        if greedy:
            q = None
        elif q is None:
            q = point_mass_q(tokens)
        s.last_seen = max(s.last_seen, now)
        self.stats.add_request(len(tokens), now - t_in)
        with self._lock:
            self._outbox.append((s.sid, DraftResponse(s.sid, seq, tokens, q,
                                                      int(max(0.0, now - t_in) * 1e6))))
