"""A draft service's state per session (its fed tokens and chain of drafts) and per batch item.

edge/star/draft_service.py's DraftService keeps one DraftSession per target session and makes a
BatchItem for each request (or draft-ahead extension) of the batch it serves.
"""
from __future__ import annotations

import hashlib
from typing import List, Optional, Tuple

import numpy as np

from edge.wire.protocol import MAX_GAMMA, DraftRequest
from edge.speculative.sampling import SamplingParams, SparseDist


def sure_prefix(entries, p_min: float) -> int:
    """How many chain entries (token, q, confidence) come before the first one below p_min."""
    return next((i for i, c in enumerate(entries) if c[2] < p_min), len(entries))


def confidence(row: np.ndarray, q) -> float:
    """The draft's top probability at this position: of its softmax over `row` (greedy), or of q,
    the distribution the token is drawn from. A function of the distribution, never of the token
    drawn: stopping on the drawn token's probability would send only the tokens q makes likely,
    so what is sent would no longer be distributed as q and the output would not be the target's
    (tests/roles/test_seed_streams.py measures exactly that)."""
    if q is None:
        z = row.astype(np.float64) - float(row.max())
        return float(1.0 / np.exp(z).sum())
    return float(np.max(q.probs if isinstance(q, SparseDist) else q))


def sid_key(sid: str) -> int:
    """A stable integer of a session id, for the session's spawn key."""
    return int.from_bytes(hashlib.blake2b(sid.encode(), digest_size=8).digest(), "little")


class DraftSession:
    def __init__(self, sid: str, now: float):
        self.sid = sid
        self.key = sid_key(sid)
        self.seq: Optional[int] = None       # engine handle, made by step
        self.fed: List[int] = []             # tokens in the KV (mirrors engine.tokens)
        self.anchor = 0                      # chain[i] proposes position anchor + i
        # (token, SparseDist or None, confidence, forced: the grammar allowed this token alone)
        self.chain: List[Tuple[int, object, float, bool]] = []
        self.start = 0                       # context length of the last request: its drafts follow
        self.mode: Optional[tuple] = None    # sampling the chain was made with
        self.params: SamplingParams = SamplingParams()   # ... as parameters, for draft-ahead
        self.k = 0                           # ... and its q's entries
        self.rng: Optional[np.random.Generator] = None
        self.last_seq = -1
        self.last_seen = now
        self.last_served = 0.0
        self.ahead_cap = 0                   # chain end draft-ahead aims for
        self.ahead_most = 0                  # ... at most (forced entries push it on, up to here)
        self.kv = 0                          # KV bytes the engine holds for it (reserved ahead of a step)
        self.grammar = None                  # the SessionGrammar its drafts follow (edge/star/draft_grammar.py)
        self.closed = False

    def end_after(self, start: int, n: int) -> Tuple[int, int]:
        """Where a chain from `start` holds n drafts the grammar left a choice at (forced entries
        ride along, uncounted: γ counts the drafts that may be wrong; past the chain every
        position counts), and the furthest forced entries may push that end: `start` + n plus
        MAX_GAMMA forced ones, a request's answer never over MAX_GAMMA tokens (the wire's cap)."""
        most = start + min(n + MAX_GAMMA, max(n, MAX_GAMMA))
        end, i = start, start - self.anchor
        while n > 0 and end < most:
            if not (0 <= i < len(self.chain) and self.chain[i][3]):
                n -= 1
            end, i = end + 1, i + 1
        return end, most

    def plan(self, start: int, gamma: int, background: bool) -> Tuple[int, int]:
        """A request for γ drafts after `start`: set where draft-ahead aims (full acceptance +
        bonus, then γ more; nothing after a background probe: the target decodes on alone past
        it) and return where its answer ends, and the furthest forced entries may push that."""
        self.start = start
        self.ahead_cap, self.ahead_most = (0, 0) if background else self.end_after(start, 2 * gamma + 1)
        return self.end_after(start, gamma)

    def unsure(self, p_min: float) -> bool:
        """The chain holds a draft for the last request's positions that the draft gives less
        than p_min: nothing past it is sent, so the request drafts no further."""
        ours = self.chain[max(0, self.start - self.anchor):]
        return sure_prefix(ours, p_min) < len(ours)


class BatchItem:
    """One session's part of a batch: tokens still to feed, chain length wanted."""

    def __init__(self, sess: DraftSession, req: Optional[DraftRequest], feed: List[int], want,
                 params: SamplingParams, k: int, t_in: float = 0.0):
        """want: the chain end wanted, or (that end, the furthest forced entries may push it)."""
        self.sess, self.req, self.feed = sess, req, feed
        self.want, self.most = want if isinstance(want, tuple) else (want, want)
        self.params, self.k, self.t_in = params, k, t_in

    def forced_taken(self) -> None:
        """The entry just proposed was the only one the grammar allowed: it rides along, not
        counted against γ, for this request and for draft-ahead alike."""
        s = self.sess
        if s.ahead_cap:
            s.ahead_cap = min(s.ahead_cap + 1, s.ahead_most)
        self.want = min(self.want + 1, self.most if self.req is not None else min(self.most, s.ahead_cap))

    def needs_step(self, p_min: float = 0.0) -> bool:
        s = self.sess
        if self.feed:
            return True
        if not s.chain or s.anchor + len(s.chain) >= self.want:
            return False
        return not s.unsure(p_min)

    def stop(self) -> None:
        """No more steps (a full context, a sequence the engine refused): answer with the chain so far."""
        s = self.sess
        self.feed = []
        self.want = s.anchor + len(s.chain) if s.chain else 0
        s.ahead_cap = 0                      # and no draft-ahead until its next request
