"""The StarSD draft service: one draft engine serving many target sessions.

A core for edge/runtime/loop.py: no thread, no I/O. Q_in holds at most one
pending DraftRequest per session (a newer one replaces an older). A `step`
takes EVERYTHING pending and drafts for all of it at once: short `append`s
are fed and drafts made with one batched `engine.step` per position over the
ragged per-session KV caches; only long feeds (a prompt) get a per-session
`forward` first. With `DraftLimits.join` a step makes ONE engine step of the
batch and requests pending join it at the next (iteration-level batching, as
vLLM's scheduler): a request arriving mid-batch waits one step, not the rest
of the batch; each is answered when its drafts are made. The step returns the
replies, (sid, message) each. A session whose context is full (or whose
sequence the engine refuses) is answered with the drafts it has; the rest of
the batch goes on, as in the shared decoder.

Per session the service keeps the tokens it has fed and a *chain* of drafted
tokens anchored after them (each with the exact q it was sampled from). A
request (keep, append, γ) names the target's context T = fed[:keep] + append;
if T runs along the chain, the drafts that follow it are reused as they are
(the draft-ahead path); otherwise the KV is cut back to the common prefix and
the rest fed. After an answer the session always holds T + drafts[:-1], which
is what the target assumes when it computes its next `keep`.

Confidence (`DraftLimits.p_min`, llama.cpp's --draft-p-min; a request's own `p_min` where the
target sends a looser one, edge/speculative/remote_gamma.py): an answer stops before a draft the draft model
gives less than p_min (its top probability there), and drafting for the request stops there too.
Where the draft is unsure the target verifies fewer tokens it would mostly reject and gets its
answer sooner. Draft-ahead still runs past it in idle time: the unsure token is the draft's
guess of the target's bonus, and when the target agrees the next answer is ready at once. Which
tokens are sent depends only on the draft's own distributions, so the output is still exactly
the target's.

A request's grammar masks the row of each of its session's proposals (edge/star/draft_grammar.py).

Batch coalescing (edge/star/batch_hold.py, `DraftLimits.coalesce`): with requests pending
and sessions just served due back within the batch's fixed cost, the step waits for them
(the loop sleeps until `wake_in`), so turns of half-size batches merge into one.

Draft-ahead (beyond the paper): when Q_in is empty, a step extends the
chains of recently served sessions as if the target accepted everything
(bonus = the draft's own next token) by one batched step, so the loop checks
its inputs between steps and real requests always come first.

Lossless either way: a draft token is always sampled from the q sent with
it, and q may be anything (docs/architecture.md) -- if its uniforms are independent of
the target's. A session samples from role_rng(seed, DRAFT, digest(sid), n), n
numbering every stream this service derives: never the target's stream, never
an earlier session's (a rejoin gets a new sid: replayed uniforms would
correlate with tokens already committed), never one replayed after a change
of sampling mode. So a seed fixes nothing about the proposals through the star
(sids and round timing vary); the target's own stream stays reproducible.
"""
from __future__ import annotations

import time
from typing import Callable, List, Optional, Tuple

from edge.engines.base import Engine
from edge.wire.protocol import DraftRequest, DraftResponse
from edge.star.batch_hold import BatchHold
from edge.star.draft_chain import BatchItem, DraftSession, confidence, sure_prefix
from edge.star.draft_grammar import DraftGrammars
from edge.star.draft_limits import DraftLimits
from edge.star.engine_sessions import EngineSessions
from edge.runtime.isolated_step import step_isolated
from edge.speculative.sampling import Role, SamplingParams, pick, role_rng

FEED_BY_STEP = 2        # appends up to this long are fed inside the batched steps


class DraftService(EngineSessions):
    """The draft core (an edge.runtime.core.HeldBatchCore): open/close/submit from any thread (a hub
    admits sessions from its own); the engine is used only by `step`, which one loop calls."""

    def __init__(self, engine: Engine, limits: Optional[DraftLimits] = None,
                 clock: Callable[[], float] = time.monotonic, name: str = "draft",
                 grammar_tokenizer=None):
        """grammar_tokenizer: for requests with a grammar (None: unconstrained drafts), draft_grammar.py."""
        super().__init__(engine, limits or DraftLimits(), clock, name)
        self._per_token = engine.kv_bytes_per_token()
        # joining serves a request at the next step anyway: nothing to hold a batch for
        self.hold = BatchHold() if self.limits.coalesce and not self.limits.join else None
        self._prefilled = False                 # the batch being served fed a prompt
        self._batch: List[BatchItem] = []       # requests being served (in flight between steps with join)
        self.grammars = DraftGrammars(grammar_tokenizer)

    # ---- sessions (the table and Q_in: draft_sessions.py; their KV: engine_sessions.py) ----
    def _new_session(self, sid: str) -> DraftSession:
        return DraftSession(sid, self.clock())

    def _arrived(self, sid: str, t: float) -> None:
        if self.hold is not None:
            self.hold.arrived(sid, t)

    def _release(self, s: DraftSession) -> None:
        if self.hold is not None:
            self.hold.forget(s.sid)
        super()._release(s)

    def kv_tokens(self) -> int:
        with self._lock:
            return sum(len(s.fed) for s in self._sessions.values())

    def _held(self, s: DraftSession, length: Optional[int] = None) -> int:
        return self.engine.seq_kv_bytes(s.seq, length)

    def _settle(self, work: List["BatchItem"]) -> None:
        """After steps: each session's reservation becomes what the engine now holds for it."""
        with self._lock:
            for w in work:
                if not w.sess.closed and w.sess.seq is not None:
                    w.sess.kv = self._held(w.sess)

    # ---- the core's step ----
    def has_work(self) -> bool:
        with self._lock:
            if self._outbox or self._to_free or self._batch:
                return True
            if self._pending:
                return self._held_until() is None
        return self.limits.ahead and bool(self._ahead_work())

    def _held_until(self) -> Optional[float]:
        """When the pending requests will be served, if the batch is held for returning sessions."""
        if self.hold is None:
            return None
        with self._lock:
            return self.hold.until(self.clock(), self._pending.keys())

    def wake_in(self) -> Optional[float]:
        """Seconds until a held batch is due (the loop's longest sleep), None if none is held."""
        t = self._held_until()
        return None if t is None else max(0.0, t - self.clock())

    def step(self) -> List[Tuple[str, object]]:
        """Free closed sessions' KV, then serve the batch (the pending requests) -- or, with
        nothing pending or in flight, one draft-ahead step. Returns the replies: (sid, DraftResponse | Error)."""
        self._free_closed()
        if not self._serve() and self.limits.ahead and not self.pending():
            self._ahead_step()
        return self._replies()

    def _serve(self) -> int:
        """Serve the batch: to completion (the pending requests taken at once), or with
        `limits.join` one engine step of it, requests pending joining first. Returns the
        number of requests in the batch."""
        t0 = self.clock()                          # busy from here: a joining prompt's prefill counts
        if self.limits.join or not self._batch:
            self._join_pending()
        if not self._batch:
            return 0
        n = len(self._batch)
        self._answer_done(t0)                      # draft-ahead hits, γ=0: no step needed
        steps = self._extend(self._batch, max_steps=1 if self.limits.join else None)
        self._settle(self._batch)
        now = self.clock()
        self._answer_done(now)
        self.stats.add_batch(n, steps, now - t0)
        if self.hold is not None:
            with self._lock:                       # a prompt's prefill is no sample of D(b)
                self.hold.batch(0 if self._prefilled else n, now - t0, now)
        return n

    def _join_pending(self) -> None:
        """Prepare the requests pending (not held back, of sessions not in the batch) into the batch."""
        if self._held_until() is not None:
            return
        self._prefilled = False
        self._batch.extend(self._prepare_taken(busy={w.sess.sid for w in self._batch}))

    def _answer_done(self, now: float) -> None:
        """Answer the batch's items that need no more steps and drop them (and closed ones)."""
        left = []
        for w in self._batch:
            if w.sess.closed:
                continue
            if w.needs_step(self._p_min(w.req)):        # a full context: _extend stops it first
                left.append(w)
            else:
                self._answer(w, now)
        self._batch = left

    # ---- one request ----
    def _prepare(self, s: DraftSession, req: DraftRequest, t_in: float) -> Optional[BatchItem]:
        lim = self.limits
        self._check_request(s, req, len(s.fed))
        self.grammars.apply(s, req, self.stats)
        T_len = req.keep + len(req.append)
        gamma = max(0, min(req.gamma, self.engine.max_len - T_len + 1))
        params = SamplingParams.from_wire(req.sampling)
        k = self._q_k(params)
        mode = (params.temperature, params.top_k, params.top_p, k) if not params.greedy else ("greedy",)
        mode += (req.grammar_id, req.grammar_from)  # a chain drafted under another grammar is no use
        if gamma == 0:                             # nothing to draft: the state stays as it is
            return BatchItem(s, req, [], 0, params, k, t_in)
        # the most it holds while served: T + drafts[:-1], as the engine allocates it. Reserved
        # now, so the next request of this batch is checked against this one's growth too
        self._reserve(s, self._held(s, max(len(s.fed), T_len + gamma - 1)),
                      f"the draft's KV memory limit of {lim.max_kv_mb:g} MB is reached; "
                      "decode alone or raise --max-kv-mb")
        if s.seq is None:
            s.seq = self.engine.new_sequence()
        if s.rng is None or s.mode != mode:      # a new stream, never an earlier one replayed
            s.rng = role_rng(params.seed, Role.DRAFT, s.key, next(self._streams))
        # does T run along fed + chain? then the chain's continuation is valid as it is
        virtual = s.fed[:s.anchor] + [c[0] for c in s.chain] if s.chain else s.fed
        along = (s.mode == mode and s.chain and s.anchor <= T_len <= len(virtual)
                 and virtual[req.keep:T_len] == list(req.append))
        if along:       # draft-ahead's chain (DraftSession.plan: where it ends, forced entries uncounted)
            want = s.plan(T_len, gamma, req.background)
            self.stats.count("ahead_hit" if s.anchor + len(s.chain) >= want[0] else "ahead_partial")
            return BatchItem(s, req, [], want, params, k, t_in)
        # cut back to the common prefix (at least one token refed, for its logits)
        target = s.fed[:req.keep] + list(req.append)
        cut = self._cut_back(s, target, start=req.keep)
        if len(target) - cut > FEED_BY_STEP:       # the prefill below: one tiled call where it pays
            cut = self._tile_cut(s, cut, len(target) - cut - 1)
        feed = target[cut:]
        if len(feed) > FEED_BY_STEP:               # a prompt: one forward call, not many steps
            self.engine.forward_last(s.seq, feed[:-1])       # KV only: one logits row, thrown away
            self._prefilled = True
            s.fed.extend(feed[:-1])
            feed = feed[-1:]
        s.anchor, s.chain, s.mode, s.params, s.k = T_len, [], mode, params, k
        return BatchItem(s, req, feed, s.plan(T_len, gamma, req.background), params, k, t_in)

    def _q_k(self, p: SamplingParams) -> int:
        k = self.limits.q_top_k
        return min(k, p.top_k) if p.top_k else k

    def _extend(self, work: List[BatchItem], max_steps: Optional[int] = None) -> int:
        """Batched steps until every item's chain reaches its `want` (or max_steps).
        Returns the number of steps."""
        steps = 0
        while max_steps is None or steps < max_steps:
            for w in work:
                if len(w.sess.fed) >= self.engine.max_len and w.needs_step():
                    self.stats.count("context_full")
                    w.stop()
            # requests stop at an unsure draft; draft-ahead (no request) goes on past it
            group = [w for w in work if w.needs_step(self._p_min(w.req)) and not w.sess.closed]
            if not group:
                break
            toks = [w.feed.pop(0) if w.feed else w.sess.chain[-1][0] for w in group]
            t0 = self.clock()
            rows = step_isolated(self.engine, [w.sess.seq for w in group], toks)
            steps += 1
            if group[0].req is not None:           # a request step, not draft-ahead's
                self.stats.add_step(len(group), self.clock() - t0)
            for w, t, row in zip(group, toks, rows):
                if row is None:              # only this session stops; the batch goes on
                    self.stats.count("step_refused")
                    w.stop()
                    continue
                w.sess.fed.append(t)
                if not w.feed:
                    self._propose(w, row)
        return steps

    def _propose(self, w: BatchItem, row) -> None:
        """Draw the session's next draft from its row (masked by its grammar, if it has one)."""
        s, grammar = w.sess, w.sess.grammar
        row = row if grammar is None else grammar.mask(s.fed, row)
        if row is None:                      # the grammar allows nothing here: answer what there is
            w.stop()
            return
        x, q = pick(row, w.params, s.rng, w.k)
        forced = grammar is not None and grammar.forced()
        # a request may only loosen the service's stop: with none, no confidence is read
        s.chain.append((x, q, confidence(row, q) if self.limits.p_min else 1.0, forced))
        if forced:                           # not counted against γ: the chain goes one further
            w.forced_taken()
        if grammar is not None and grammar.ends(x):
            w.stop()                         # the text ends here: nothing after it to draft

    def _p_min(self, req: Optional[DraftRequest]) -> float:
        """The confidence stop for a request: this service's, or the request's own where that is
        looser (a target whose verify is nearly free takes the unsure drafts too; none may make the
        service stricter: a draft whose top probabilities are low but right -- an uncalibrated one
        -- would then send nothing). 0 (no stop) for draft-ahead."""
        if req is None:
            return 0.0
        return self.limits.p_min if req.p_min is None else min(self.limits.p_min, req.p_min)

    def _answer(self, w: BatchItem, now: float) -> None:
        s, req = w.sess, w.req
        if s.closed:
            return
        T_len = req.keep + len(req.append)
        start = T_len - s.anchor
        got = s.chain[start:start + max(0, w.want - T_len)] if s.chain and start >= 0 else []
        sure = sure_prefix(got, self._p_min(req))
        if sure < len(got):
            self.stats.count("unsure_stops")
            got = got[:sure]
        tokens = [c[0] for c in got]
        q = None if w.params.greedy else [(c[1].indices, c[1].probs) for c in got]
        s.last_served = now
        s.last_seen = max(s.last_seen, now)  # silence counts from our answer: a slow batch must not evict
        compute_us = int(max(0.0, now - w.t_in) * 1e6)
        if self.hold is not None:
            with self._lock:
                self.hold.answered(s.sid, now)
        self.stats.add_request(len(tokens), now - w.t_in)
        self._reply(s.sid, DraftResponse(s.sid, req.seq, tokens, q, compute_us))

    def _reset(self, s: DraftSession) -> None:
        self._empty_sequence(s)
        s.fed, s.chain, s.anchor, s.mode = [], [], 0, None

    # ---- draft-ahead ----
    def _ahead_work(self) -> List[BatchItem]:
        """The recently served sessions whose chains draft-ahead would extend now."""
        now = self.clock()
        with self._lock:
            if self._pending:
                return []
            cands = sorted((s for s in self._sessions.values()
                            if s.chain and s.seq is not None and not s.closed
                            and now - s.last_served < self.limits.ahead_recent_s
                            and s.anchor + len(s.chain) < min(s.ahead_cap, self.engine.max_len)),
                           key=lambda s: -s.last_served)[: self.limits.ahead_sessions]
        grow = sum(max(0, self._held(s, len(s.fed) + 1) - s.kv) for s in cands)   # one token each
        if not cands or self.kv_bytes() + grow > self._kv_limit():
            return []
        return [BatchItem(s, None, [], min(s.ahead_cap, self.engine.max_len), s.params, s.k) for s in cands]

    def _ahead_step(self) -> int:
        """Extend recently served sessions' chains by one batched step; returns the steps made."""
        work = self._ahead_work()
        if not work:
            return 0
        t0 = self.clock()
        with self._lock:                           # reserved, as for requests
            for w in work:
                w.sess.kv = max(w.sess.kv, self._held(w.sess, len(w.sess.fed) + 1))
        steps = self._extend(work, max_steps=1)
        self._settle(work)
        self.stats.add_ahead(steps * len(work), self.clock() - t0)
        return steps
