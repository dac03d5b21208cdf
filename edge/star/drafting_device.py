"""The reverse star's device: a small model drafts here, the hub's target verifies
(edge/star/verify_service.py), and what the device serves is the target's output alone.

Each round the device drafts γ tokens after the committed text with its own model (ModelDrafter:
sampled drafts come with the exact top-k q they were drawn from), sends them in a VerifyRequest on
its session and commits what the answer says: drafts[:accepted] + [token], the token being the
target's correction or bonus. Nothing else is ever committed, so greedy output is exactly the
target's greedy text and sampled output has exactly the target's distribution (the hub's
verify_stochastic), whatever the draft proposed. γ is fixed or, with adaptive=True, chosen each round
from the measured round trips, draft steps and acceptance (edge/star/reverse_gamma.py).

The device cannot decode alone: when the hub does not answer (a lost message, a restarted hub) it
resends and rejoins -- from the committed text, so no token is lost or repeated -- and when it still
has no answer after `answer_timeout` s, or cannot join, the generation raises HubUnavailable: the
endpoint answers 503, never draft-only text.

Constrained output and logprobs (edge/star/verify_rules.py has the hub's side): with a grammar (a
response_format's, a forced tool_choice's) the hub masks every verify row by it, so what is committed
is the target's constrained output; the device drafts under the same grammar only to be accepted more
often, the tokens it forces riding along as drafts (up to the γ it joined with, which the hub admitted:
a round whose adaptive γ is smaller fills up with forced tokens). The request carries
the grammar's text whenever it sends the whole context (a session's first request, a resync). Each
committed token's logprobs come in the answer, computed from the target's rows at the hub, never the
draft's.

Random streams: the draft samples from role_rng(seed, DRAFT); the hub accepts with its TARGET stream,
restarted at a generation's first request (`start`), so with a fixed γ a seeded generation replays.
"""
from __future__ import annotations

import logging
import threading
from collections import deque
import time
from typing import Callable, Iterable, List, Optional, Sequence

from edge.engines.base import Engine
from edge.speculative.drafter import Drafter
from edge.speculative.generate import CallTiming, GenResult, ModelDrafter
from edge.speculative.sampling import GREEDY, Role, SamplingParams, SparseDist, role_rng
from edge.star.hub_client import HubClient, JoinRefused, Session
from edge.star.reverse_gamma import ReverseGamma
from edge.wire.protocol import (E_BAD_GRAMMAR, E_BAD_KEEP, E_CONTEXT_FULL, MAX_GAMMA, MAX_TOP_K, Error,
                                VerifyRequest, VerifyResponse)

log = logging.getLogger(__name__)
__all__ = ["DraftingDevice", "GrammarRefused", "HubUnavailable"]


class HubUnavailable(RuntimeError):
    """The hub cannot verify now (gone, refusing, or silent): no token of the target can be served."""


class GrammarRefused(ValueError):
    """The hub cannot follow this generation's grammar (the reason says why): nothing is served."""


class _Context:
    """One generation's committed tokens and what its session holds of them."""

    def __init__(self, prompt: List[int], grammar=None, logprobs: Optional[int] = None):
        self.tokens = list(prompt)
        self.keep, self.append = 0, list(prompt)    # the first request sends the whole prompt
        self.started = False                        # an answer came: the hub's stream is running
        self.grammar, self.grammar_from, self.logprobs = grammar, len(prompt), logprobs

    def request(self, session: Session, seq: int, drafts: List[int], q, params: SamplingParams) -> VerifyRequest:
        """This round's request: the grammar's text goes with a request that sends the whole context."""
        g = self.grammar
        return VerifyRequest(session.sid, seq, self.keep, self.append, drafts, q, params.to_wire(),
                             start=not self.started, grammar_id=g.id if g else "",
                             grammar=g.text if g and self.keep == 0 else "",
                             grammar_from=self.grammar_from if g else 0, logprobs=self.logprobs)

    def resync(self) -> None:
        """The hub holds nothing of it (a new session, bad_keep): send it all again."""
        self.keep, self.append = 0, list(self.tokens)


class DraftingDevice:
    """A drafting device: its draft engine, its link to the hub, and generation through the hub."""

    def __init__(self, engine: Engine, hub: HubClient, gamma: int = 4, adaptive: bool = False,
                 join_timeout: float = 3.0, answer_timeout: float = 30.0, resend_after: float = 1.0,
                 q_top_k: int = 32, drafter_of: Optional[Callable[[SamplingParams, int], Drafter]] = None):
        """gamma: tokens drafted a round (adaptive: the most, each round choosing 0..gamma).
        answer_timeout: how long a round may go unanswered (resent every resend_after s, rejoining
        when the session is lost) before the generation fails with HubUnavailable.
        drafter_of(params, q_top_k): a generation's drafter (default: a ModelDrafter of `engine`;
        any edge.speculative.drafter.Drafter proposes as well, e.g. an n-gram or suffix one)."""
        if not 1 <= gamma <= MAX_GAMMA:
            raise ValueError(f"gamma must be in 1..{MAX_GAMMA} for a drafting device, got {gamma}")
        if not 1 <= q_top_k <= MAX_TOP_K:
            raise ValueError(f"q_top_k must be in 1..{MAX_TOP_K}, got {q_top_k}")
        if hub.role != "drafter":
            raise ValueError("a drafting device joins as role 'drafter': HubClient(..., role='drafter')")
        self.engine, self.hub, self.gamma, self.adaptive = engine, hub, gamma, adaptive
        self.join_timeout, self.answer_timeout, self.resend_after = join_timeout, answer_timeout, resend_after
        self.q_top_k = q_top_k
        self.drafter_of = drafter_of or (lambda params, k: ModelDrafter(engine, params, k))
        self.lock = threading.Lock()
        self._idle: List[Session] = []              # sessions of finished generations, kept for the next
        self.counts = {"generations": 0, "tokens": 0, "accepted": 0, "drafted": 0, "rounds": 0,
                       "resent": 0, "rejoined": 0, "busy_s": 0.0}
        self.last_gamma: Optional[ReverseGamma] = None
        self._rtts: deque = deque(maxlen=16)        # recent round trips: the resend interval follows them
        self._t0 = time.monotonic()
        hub.start()

    def telemetry(self) -> dict:
        with self.lock:
            return {**self.counts, "sessions": len(self.hub.sessions), "wall_s": time.monotonic() - self._t0,
                    "dropped": dict(self.hub.keys.dropped)}

    def check_join(self, params: SamplingParams = GREEDY) -> None:
        """Join once (the session is kept for the first generation): raises HubUnavailable."""
        s = self._join(params)
        with self.lock:
            self._idle.append(s)

    def close(self) -> None:
        with self.lock:
            idle, self._idle = self._idle, []
        for s in idle:
            s.close()

    # ---- sessions ----
    def _join(self, params: SamplingParams) -> Session:
        try:
            return self.hub.join(self.gamma, params.to_wire(), timeout=self.join_timeout)
        except JoinRefused as e:
            raise HubUnavailable(f"the hub cannot verify for this device: {e.reason}") from None
        except TimeoutError as e:
            raise HubUnavailable(f"the hub is unreachable, so the target cannot be served: {e}") from None

    def _session(self, params: SamplingParams) -> Session:
        with self.lock:
            while self._idle:
                s = self._idle.pop()
                if not s.lost:
                    return s
        return self._join(params)

    # ---- generation ----
    def generate(self, prompt_ids: Sequence[int], max_new: int, params: SamplingParams = GREEDY,
                 stop_ids: Iterable[int] = (), on_token: Optional[Callable[[int], None]] = None,
                 grammar=None, logprobs: Optional[int] = None,
                 on_logprob: Optional[Callable[[int, float, list], None]] = None) -> GenResult:
        """The target's output for the prompt, drafted here and verified at the hub. Raises
        HubUnavailable when the hub cannot serve it (what was committed before stays committed).
        grammar: an edge.speculative.grammar.Grammar the output follows (the hub masks the target's
        rows with it; GrammarRefused when it cannot); logprobs: alternatives per token, handed to
        on_logprob(token, logprob, [(id, logprob), ...]) just before on_token."""
        if params.adjusts_logits:
            raise ValueError("penalties and logit_bias are not applied by the hub's verify service yet")
        prompt = [int(t) for t in prompt_ids]
        if not prompt:
            raise ValueError("the prompt is empty; give at least one token (e.g. the BOS token)")
        session = self._session(params)
        drafter = self.drafter_of(params, 0 if params.greedy else min(self.q_top_k, params.top_k or MAX_TOP_K))
        drafter.constrain(grammar, len(prompt))           # drafts under the grammar: more of them accepted
        gamma = ReverseGamma(self.gamma) if self.adaptive else None
        self.last_gamma = gamma
        ctx, res, stops = _Context(prompt, grammar, logprobs), GenResult(tokens=[]), {int(t) for t in stop_ids}
        stops |= set(grammar.stop_ids) if grammar is not None else set()   # the grammar's end ends the text
        draft_rng = role_rng(params.seed, Role.DRAFT)
        t0 = time.perf_counter()
        try:
            while res.finish_reason == "length" and res.n_generated < max_new:
                g = min(gamma.next_gamma() if gamma else self.gamma, max_new - res.n_generated - 1)
                res.gammas.append(g)
                drafts, qs, dt = [], [], 0.0
                if g > 0:
                    t = time.perf_counter()
                    drafts, qs = drafter.draft(ctx.tokens, g, draft_rng)
                    # forced tokens ride along under a grammar (ModelDrafter proposes them on top of g),
                    # up to the γ joined with: the hub admitted that many drafts a request
                    keep = g if grammar is None else min(self.gamma, max_new - res.n_generated - 1)
                    drafts = [int(x) for x in drafts][:keep]
                    dt = time.perf_counter() - t
                    res.timings.append(CallTiming("draft", len(drafts), dt))
                q = None if params.greedy else _wire_q(drafts, qs)
                session, resp, rtt = self._round(session, ctx, drafts, q, params)
                if resp is None:                          # the hub's target is full
                    res.finish_reason = "context"
                    break
                res.timings.append(CallTiming("verify", len(drafts) + 1, rtt))
                res.n_verify_calls += 1
                res.n_drafted += len(drafts)
                res.n_accepted += resp.n_accepted
                if gamma is not None:
                    gamma.drafted(len(drafts), dt)
                    gamma.answered(len(drafts), resp.n_accepted, rtt)
                before = len(ctx.tokens)
                self._commit(ctx, res, drafts[:resp.n_accepted] + [resp.token], stops, max_new, on_token,
                             _entries(resp) if on_logprob is not None else None, on_logprob)
                # the next request names this round's tokens itself: a copy of this request that the
                # hub served once more (its answer came for another copy) verified anew, and what the
                # hub then holds past `before` may differ from what was committed here
                ctx.keep, ctx.append = before, ctx.tokens[before:]
        except BaseException:
            session.close()
            raise
        finally:
            drafter.close()
            res.wall_s = time.perf_counter() - t0
            with self.lock:
                self.counts["busy_s"] += res.wall_s
                self.counts["drafted"] += res.n_drafted
                self.counts["accepted"] += res.n_accepted
                self.counts["rounds"] += res.n_verify_calls
        with self.lock:
            self.counts["generations"] += 1
            self._idle.append(session)                     # its KV at the hub serves the next prompt's prefix
        return res

    def _commit(self, ctx: _Context, res: GenResult, tokens: List[int], stops: set, max_new: int,
                on_token: Optional[Callable[[int], None]], entries: Optional[list] = None,
                on_logprob: Optional[Callable] = None) -> None:
        for i, t in enumerate(tokens):
            ctx.tokens.append(t)                          # what the hub holds, the stop token included
            if t in stops:
                res.stop_token, res.finish_reason = t, "stop"
                return
            res.tokens.append(t)
            with self.lock:
                self.counts["tokens"] += 1
            if entries:
                on_logprob(t, *entries[i])
            if on_token is not None:
                on_token(t)
            if res.n_generated >= max_new:
                return

    # ---- one round trip ----
    def _round(self, session: Session, ctx: _Context, drafts: List[int], q, params: SamplingParams):
        """(session, the hub's VerifyResponse or None when its context is full, round trip seconds):
        resent while unanswered, rejoined when the session is lost; HubUnavailable past answer_timeout."""
        give_up = time.monotonic() + self.answer_timeout
        sent: dict = {}                                   # seq -> when: every copy of this request
        while True:
            if session.lost:
                session = self._rejoin(session, ctx, params, give_up)
                sent = {}                                 # another session: the old copies are void
            seq = session.next_seq()
            sent[seq] = time.monotonic()
            session.send(ctx.request(session, seq, drafts, q, params))
            got = session.wait_any(sent, min(give_up, sent[seq] + self._resend_s()))
            msg = got[0] if got is not None else None
            if isinstance(msg, VerifyResponse) and self._valid(msg, ctx, drafts):
                ctx.started = True
                rtt = got[1] - sent[msg.seq]
                self._rtts.append(rtt)
                return session, msg, rtt
            if isinstance(msg, Error):
                if msg.code == E_CONTEXT_FULL:
                    return session, None, got[1] - sent.get(msg.seq, got[1])
                if msg.code == E_BAD_KEEP:
                    ctx.resync()
                    sent = {}                             # the copies named the old keep
                elif msg.code == E_BAD_GRAMMAR:
                    raise GrammarRefused(f"the hub's target cannot follow this request's grammar: {msg.message}")
                else:                                     # unknown_session, internal, overloaded: anew
                    log.info("%s: the hub answered %s (%s); rejoining", self.hub.client, msg.code, msg.message)
                    session.mark_lost()
            if time.monotonic() >= give_up:
                session.mark_lost()
                raise HubUnavailable(f"the hub did not verify within {self.answer_timeout:g} s; the target's "
                                     "output cannot be served without it (no draft-only text is)")
            if msg is None:
                with self.lock:
                    self.counts["resent"] += 1

    def _resend_s(self) -> float:
        """How long a request goes unanswered before it is sent again: resend_after, or four times
        the slowest of the recent round trips (a hub busy with a prompt is not a lost message)."""
        return max(self.resend_after, 4.0 * max(self._rtts, default=0.0))

    def _rejoin(self, old: Session, ctx: _Context, params: SamplingParams, give_up: float) -> Session:
        old.close()
        while True:
            try:
                s = self._join(params)
                break
            except HubUnavailable:
                if time.monotonic() >= give_up:
                    raise
                time.sleep(min(0.2, max(0.0, give_up - time.monotonic())))   # the hub restarting: again
        with self.lock:
            self.counts["rejoined"] += 1
        ctx.resync()
        return s

    @staticmethod
    def _valid(msg: VerifyResponse, ctx: _Context, drafts: List[int]) -> bool:
        """An answer that fits what was asked (else it is dropped and the round resent)."""
        return (msg.n_accepted <= len(drafts) and msg.held == len(ctx.tokens) + msg.n_accepted + 1
                and (ctx.logprobs is None or len(msg.logprobs) == msg.n_accepted + 1))


def _entries(resp: VerifyResponse) -> list:
    """The answer's logprob entries as on_logprob takes them: (logprob, [(id, logprob), ...])."""
    return [(lp, list(zip(ids, lps))) for lp, ids, lps in resp.logprobs]


def _wire_q(drafts: List[int], qs) -> list:
    """Each draft's q as sent: the exact sparse q it was drawn from; one-hot where the drafter gives
    none (a deterministic proposal, exact as in StarSD)."""
    qs = list(qs or [])[:len(drafts)]
    qs += [SparseDist.one_hot(x) for x in drafts[len(qs):]]
    if not all(isinstance(d, SparseDist) for d in qs):
        raise ValueError("a drafting device sends sparse q only: draft with a top-k (q_top_k) distribution")
    return [(d.indices, d.probs) for d in qs]
