"""Suffix proposals when they score high, the model draft's otherwise (one service).

Every request first syncs the session's suffix trees (so the fleet tree learns from all
sessions either way); if the suffix proposal's score -- its expected accepted tokens
under the trees' counts -- reaches `min_score`, it is the answer and the draft model does
nothing. Otherwise the request goes to the wrapped DraftService, translated: the model
holds what its last answer left (T + its drafts[:-1]), not what the target assumes after
a suffix answer, so `keep` for it is the common prefix of the two. Its whole batch runs
inside this step, and its answers (with their exact q) go back as they are.

Lossless either way: each answer carries the q its tokens were drawn from (a point mass
for a suffix proposal, the model's sampled top-k otherwise).
"""
from __future__ import annotations

from typing import List, Optional, Tuple

from edge.common_prefix import common_prefix
from edge.protocol import DraftRequest, DraftResponse, Error
from edge.roles.draft import DraftService
from edge.roles.draft_limits import DraftRefused
from edge.roles.suffix_draft import SuffixDraftService, _greedy
from edge.suffix_drafter import SuffixConfig
from edge.suffix_tree import SuffixTree

MIN_SCORE = 1.5          # expected accepted suffix tokens that beat asking the model


class HybridDraftService(SuffixDraftService):
    counts_sessions = False               # the model's core counts them, in the same stats
    def __init__(self, model: DraftService, cfg: Optional[SuffixConfig] = None,
                 shared: Optional[SuffixTree] = None, min_score: float = MIN_SCORE,
                 name: Optional[str] = None):
        super().__init__(model.vocab_size, model.limits, cfg, shared, model.clock, name or model.name,
                         model.fingerprint)
        self.model = model
        self.min_score = float(min_score)
        self.stats = model.stats          # one account: the model's batches, every answer

    # ---- sessions: both cores ----
    def open(self, sid: str) -> None:
        self.model.open(sid)              # the model's limits (sessions, KV) refuse first
        try:
            super().open(sid)
        except DraftRefused:
            self.model.close(sid, "refused")
            raise
        s = self._sessions[sid]
        s.model_held = []                 # what the model holds after its last answer
        s.waiting = {}                    # seq -> (context, arrival) of requests the model drafts

    def close(self, sid: str, reason: str = "bye") -> bool:
        self.model.close(sid, reason)
        return super().close(sid, reason)

    def has_work(self) -> bool:
        return super().has_work() or self.model.has_work()

    def wake_in(self):
        return self.model.wake_in()          # a batch the model holds

    # ---- the step ----
    def step(self) -> List[Tuple[str, object]]:
        for s, req, t_in in self._take():
            try:
                self._context(s, req)
            except DraftRefused as e:
                self._reply(s.sid, Error(s.sid, req.seq, e.code, e.reason))
                continue
            p = s.ctx.propose(req.gamma)
            if p.tokens and p.score >= self.min_score:
                self.stats.count("hybrid_suffix")
                self.answer(s, req.seq, _greedy(req), s.ctx.tokens, p.tokens, t_in)
                continue
            self.stats.count("hybrid_model")
            context = list(s.ctx.tokens)
            keep = min(common_prefix(s.model_held, context), len(context) - 1)
            s.waiting = {req.seq: (context, t_in)}     # the model answers it within this step
            self.model.submit(DraftRequest(s.sid, req.seq, keep, context[keep:], req.gamma, req.sampling))
        if self.model.has_work():
            for sid, msg in self.model.step():
                self._from_model(sid, msg)
        return self._replies()

    def _from_model(self, sid: str, msg) -> None:
        s = self._sessions.get(sid)
        if s is None:
            return
        w = s.waiting.pop(getattr(msg, "seq", -1), None)
        if isinstance(msg, DraftResponse):
            if w is None:                 # not ours to answer (replaced meanwhile)
                return
            context, t_in = w
            s.model_held = context + [int(t) for t in msg.tokens[:-1]]
            self.answer(s, msg.seq, msg.q is None, context, msg.tokens, t_in, msg.q)
        elif isinstance(msg, Error):
            s.model_held = []             # unknown now: the next model request resends everything
            self._reply(sid, msg)
