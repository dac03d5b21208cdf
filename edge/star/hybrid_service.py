"""Suffix proposals when they score high, the model draft's otherwise (one service).

Every request first syncs the session's suffix trees (so the fleet tree learns from all
sessions either way). The suffix proposal is the answer, and the draft model does nothing,
when its score -- its expected accepted tokens under the trees' counts, scaled by what this
session's suffix answers kept per unit of score -- reaches `min_score` and what the model's
answers have kept this session. (Both are measured from the next request: its context says
how many drafts of the last answer the target kept.) A new session starts from the fleet's
yields (every session's answers folded in, slower): its own first answers decide little, and
short sessions are mostly start -- on BFCL a fresh session used to spend its first rounds on
2-token suffix guesses where the model would have kept 6. So where the model draft agrees almost
always (function calls: the 0.5B kept 98-100% on BFCL) a 2-token suffix guess does not
displace its 6, and where the suffix copies whole lines (code edits) the model is not asked.
Otherwise the request goes to the wrapped DraftService, translated: the model holds what
its last answer left (T + its drafts[:-1]), not what the target assumes after a suffix
answer, so `keep` for it is the common prefix of the two. Its whole batch runs inside this
step, and its answers (with their exact q) go back as they are.

While the suffix half answers, the model falls behind the target's context; the first model
request after a long suffix run (or after a prompt the suffix answered: a fleet tree that
knows how answers open scores there) would pay a prefill of the lag inside a round, past the
target's deadline -- and after three misses the target rejoins and the new session's prompt
lands on the model again. So a step with nothing to answer catches one lagging session's
model up (a sync: a request of the last seen context, its answer kept, never sent).

Lossless either way: each answer carries the q its tokens were drawn from (a point mass
for a suffix proposal, the model's sampled top-k otherwise).
"""
from __future__ import annotations

from typing import Optional

from edge.speculative.common_prefix import common_prefix
from edge.wire.protocol import DraftRequest, DraftResponse, Error
from edge.star.draft_service import DraftService
from edge.star.draft_limits import DraftRefused
from edge.star.suffix_service import SuffixDraftService, _greedy
from edge.speculative.suffix_drafter import SuffixConfig
from edge.speculative.suffix_tree import SuffixTree

MIN_SCORE = 1.5          # expected accepted suffix tokens that beat asking the model
SYNC_LAG = 8             # the model behind by more tokens than this: caught up in idle time
EMA = 0.3                # weight of the newest answer in the per-session yields
FLEET_EMA = 0.1          # ... and in the fleet's, a new session's prior


class HybridDraftService(SuffixDraftService):
    """The mixed draft core (an edge.runtime.core.HeldBatchCore: the model's held batch)."""
    counts_sessions = False               # the model's core counts them, in the same stats
    def __init__(self, model: DraftService, cfg: Optional[SuffixConfig] = None,
                 shared: Optional[SuffixTree] = None, min_score: float = MIN_SCORE,
                 name: Optional[str] = None):
        super().__init__(model.vocab_size, model.limits, cfg, shared, model.clock, name or model.name,
                         model.fingerprint)
        self.model = model
        self.min_score = float(min_score)
        self.stats = model.stats          # one account: the model's batches, every answer
        self._behind: dict = {}           # sids whose model may lag (an ordered set)
        # every session's yields folded together: a new session's prior (its own first answers
        # decide little, and short sessions are mostly start)
        self.fleet_model_yield: Optional[float] = None
        self.fleet_suffix_cal = 1.0

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
        s.sync = None                     # (seq, context) of the catch-up the model serves
        s.sampling = None                 # the last request's, for a catch-up
        s.answered = None                 # (source, context length, drafts, score) of the last answer
        s.model_yield = self.fleet_model_yield   # drafts kept per model answer (EMA); None: none scored yet
        s.suffix_cal = self.fleet_suffix_cal     # drafts kept per unit of suffix score (EMA)

    def close(self, sid: str, reason: str = "bye") -> bool:
        self.model.close(sid, reason)
        return super().close(sid, reason)

    def has_work(self) -> bool:
        return super().has_work() or self.model.has_work() or bool(self._behind)

    def wake_in(self):
        return self.model.wake_in()          # a batch the model holds

    # ---- the step (SuffixDraftService.step: each request synced, then _draft; then _stepped) ----
    def _draft(self, s, req: DraftRequest, t_in: float) -> None:
        """The suffix proposal if it scores high enough, else a request to the model."""
        s.sampling = req.sampling
        self._score_last(s)
        p = s.ctx.propose(req.gamma)
        y = s.suffix_cal * p.score     # what the proposal is expected to yield, calibrated
        if p.tokens and y >= self.min_score and (s.model_yield is None or y >= s.model_yield):
            self.stats.count("hybrid_suffix")
            s.answered = ("suffix", len(s.ctx.tokens), list(p.tokens), p.score)
            self.answer(s, req.seq, _greedy(req), s.ctx.tokens, p.tokens, t_in)
            self._behind[s.sid] = None
            return
        self.stats.count("hybrid_model")
        context, keep = _model_feed(s)
        s.waiting = {req.seq: (context, t_in)}     # the model answers it within this step
        self.model.submit(DraftRequest(s.sid, req.seq, keep, context[keep:], req.gamma, req.sampling,
                                       req.background, req.p_min, req.grammar_id, req.grammar,
                                       req.grammar_from))
        self._behind.pop(s.sid, None)

    def _stepped(self, n: int, t0) -> None:
        """The model's part: a catch-up in idle time, then its batch (the stats are the model's)."""
        if not n and not self.model.has_work():
            self._sync_one()
        if self.model.has_work():
            for sid, msg in self.model.step():
                self._from_model(sid, msg)

    def _score_last(self, s) -> None:
        """Fold how many drafts of the last answer the target kept into that source's yield, the
        session's and the fleet's."""
        if s.answered is None:
            return
        source, L, drafts, score = s.answered
        s.answered = None
        kept = common_prefix(drafts, s.ctx.tokens[L:L + len(drafts)])
        if len(s.ctx.tokens) - L < min(len(drafts), kept + 1):
            return                        # the target has not gone past these drafts: no verdict
        if source == "model":
            s.model_yield = _ema(s.model_yield, kept, EMA)
            self.fleet_model_yield = _ema(self.fleet_model_yield, kept, FLEET_EMA)
        elif score > 0:
            s.suffix_cal = _ema(s.suffix_cal, kept / score, EMA)
            self.fleet_suffix_cal = _ema(self.fleet_suffix_cal, kept / score, FLEET_EMA)

    def _sync_one(self) -> None:
        """Submit a catch-up for the first lagging session, if its model lags by > SYNC_LAG."""
        while self._behind:
            sid = next(iter(self._behind))
            del self._behind[sid]
            with self._lock:
                s = self._sessions.get(sid)
            if s is None or s.closed or s.sampling is None:
                continue
            context, keep = _model_feed(s)
            if len(context) - keep <= SYNC_LAG:
                continue
            # the seq of the target's last request: answered by the suffix, so the model never saw it
            s.sync = (s.last_seq, context)
            self.stats.count("hybrid_sync")
            self.model.submit(DraftRequest(sid, s.last_seq, keep, context[keep:], 1, s.sampling,
                                           background=True))
            return

    def _from_model(self, sid: str, msg) -> None:
        s = self._sessions.get(sid)
        if s is None:
            return
        seq = getattr(msg, "seq", -1)
        if s.sync is not None and s.sync[0] == seq and seq not in s.waiting:   # a catch-up: never sent
            context, s.sync = s.sync[1], None
            s.model_held = context + [int(t) for t in msg.tokens[:-1]] if isinstance(msg, DraftResponse) else []
            return
        w = s.waiting.pop(seq, None)
        if isinstance(msg, DraftResponse):
            if w is None:                 # not ours to answer (replaced meanwhile)
                return
            context, t_in = w
            s.model_held = context + [int(t) for t in msg.tokens[:-1]]
            s.answered = ("model", len(context), [int(t) for t in msg.tokens], 0.0)   # none sent: kept 0
            self.answer(s, msg.seq, msg.q is None, context, msg.tokens, t_in, msg.q)
        elif isinstance(msg, Error):
            s.model_held = []             # unknown now: the next model request resends everything
            self._reply(sid, msg)


def _model_feed(s) -> tuple:
    """(the session's context, how much of it the model holds): a model request keeps that much and
    feeds the rest (at least the last token, whose logits the drafting starts from)."""
    context = list(s.ctx.tokens)
    return context, min(common_prefix(s.model_held, context), len(context) - 1)


def _ema(old: Optional[float], x: float, w: float) -> float:
    return x if old is None else (1 - w) * old + w * x
