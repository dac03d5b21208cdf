"""A StarSD draft service with no model: suffix-tree proposals (edge/speculative/suffix_drafter.py).

The same core interface as DraftService (open/close/submit/step on edge/runtime/loop.py,
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

import time
from typing import Callable, List, Optional, Tuple

import numpy as np

from edge.wire.protocol import DraftRequest, DraftResponse, Error
from edge.star.draft_limits import DraftLimits, DraftRefused
from edge.star.draft_sessions import DraftSessions
from edge.speculative.sampling import SamplingParams
from edge.speculative.suffix_drafter import SuffixConfig, SuffixContext
from edge.speculative.suffix_tree import SuffixTree


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


class SuffixDraftService(DraftSessions):
    """The model-free draft core (an edge.runtime.core.EngineCore): open/close/submit from any
    thread; `step` (one loop) answers everything pending."""
    full_hint = "raise --max-sessions (a suffix draft costs microseconds a request) or add a draft service"

    def __init__(self, vocab_size: int, limits: Optional[DraftLimits] = None,
                 cfg: Optional[SuffixConfig] = None, shared: Optional[SuffixTree] = None,
                 clock: Callable[[], float] = time.monotonic, name: str = "suffix", fingerprint: str = ""):
        super().__init__(limits or DraftLimits(), clock, name, vocab_size)
        self.cfg = cfg or SuffixConfig()
        self.shared = shared if shared is not None else self.cfg.global_tree()
        self.fingerprint = fingerprint

    # ---- sessions (the table and Q_in: edge/star/draft_sessions.py) ----
    def _new_session(self, sid: str) -> _Session:
        return _Session(sid, self.cfg, self.shared, self.clock())

    def _release(self, s: _Session) -> None:
        s.ctx.close()                     # its outputs stay in the global tree

    def kv_tokens(self) -> int:
        """Tokens held for the sessions (their local trees' text)."""
        with self._lock:
            return sum(len(s.ctx.tokens) for s in self._sessions.values())

    def has_work(self) -> bool:
        with self._lock:
            return bool(self._outbox or self._pending)

    # ---- the core's step (the hybrid's too: it overrides _draft and _stepped) ----
    def step(self) -> List[Tuple[str, object]]:
        """Answer everything pending; returns the replies: (sid, DraftResponse | Error). Each
        request's context is checked and synced first (a refusal is answered with its Error),
        then drafted for (_draft); _stepped closes the step."""
        taken = self._take()
        t0 = self.clock() if taken else None
        for s, req, t_in in taken:
            try:
                self._context(s, req)
            except DraftRefused as e:
                self._reply(s.sid, Error(s.sid, req.seq, e.code, e.reason))
                continue
            self._draft(s, req, t_in)
        self._stepped(len(taken), t0)
        return self._replies()

    def _draft(self, s: _Session, req: DraftRequest, t_in: float) -> None:
        """Answer a synced request: the suffix trees' proposal."""
        p = s.ctx.propose(req.gamma)
        self.stats.count(f"proposed_{s.ctx.source}" if p.tokens else "proposed_none")
        self.answer(s, req.seq, _greedy(req), s.ctx.tokens, p.tokens, t_in)

    def _stepped(self, n: int, t0: Optional[float]) -> None:
        """After the step's `n` requests (taken at t0; None with none): the batch's account."""
        if n:
            self.stats.add_batch(n, 0, self.clock() - t0)

    def _context(self, s: _Session, req: DraftRequest) -> None:
        """Check the request and sync the session's trees to its context T = held[:keep] + append."""
        self._check_request(s, req, len(s.held))
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
        self._reply(s.sid, DraftResponse(s.sid, seq, tokens, q, int(max(0.0, now - t_in) * 1e6)))
