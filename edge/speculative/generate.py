"""Local generation loops over the Engine interface: target-only and speculative.

Both loops prefill the prompt's new tokens in one call whose last row picks the first token
(`_Run.take_first_row`): no second call for the last prompt token, and through the star the first
token never waits on the hub. Every later token comes out of a target call over
[pending, drafts...]; the prefill counts as one target call that yielded one token, so
"tokens per verification" counts exactly what each target call yielded.

Stop tokens: generation ends at the first stop token; it is NOT put in
`tokens` (nor passed to on_token) but it is reported in `stop_token` and
counted in `n_generated` and against `max_new` (the target did generate it).

Penalties and logit_bias (SamplingParams.adjusts_logits) adjust every target
row before it is argmaxed, sampled or verified (adjust_logits), each row with
the tokens before its position: plain and speculative decoding see the same
distribution. on_logits(token, row) hands the caller that adjusted row for
each committed token (logprobs: the same row whether the token was drafted).

Grammar-forced tokens (the grammar's mask allows one token only) are committed without a target
call and fed with the next one (edge/speculative/jump_forward.py): the committed tokens not yet
in the target's KV are `_Run.pending()`, and each call feeds them ahead of its drafts. Forced
tokens among a round's drafts ride along γ uncounted, those after the last draft appended by the
target (jump_forward.with_forced): one call verifies pending, drafts and forced tokens together.
"""
from __future__ import annotations

import time
from typing import Callable, Iterable, List, Optional, Sequence, Tuple

import numpy as np

from edge.speculative.constrained import grammar_matcher, legal_drafts, mask_rows
from edge.speculative.drafter import Drafter
from edge.speculative.model_drafter import ModelDrafter  # noqa: F401  (re-exported: callers import it from here)
from edge.speculative.gamma_rounds import GammaRounds
from edge.speculative.gen_result import CallTiming, GenResult
from edge.speculative.jump_forward import jump_forward, verified_rows, with_forced
from edge.speculative.prefix_cache import PrefixCache, give_back, take_sequence
from edge.engines.base import Engine
from edge.engines.batched_calls import join_rounds, served_round
from edge.speculative.sampling import (GREEDY, Role, SamplingParams, SparseDist, adjust_logits, pick, role_rng,
                                to_probs)
from edge.speculative.verify import verify_greedy, verify_stochastic


def _check_prompt(prompt_ids: Sequence[int], max_new: int) -> List[int]:
    prompt = [int(t) for t in prompt_ids]
    if not prompt:
        raise ValueError("the prompt is empty; give at least one token (e.g. the BOS token)")
    if isinstance(max_new, bool) or not isinstance(max_new, int) or max_new < 0:
        raise ValueError(f"max_new must be an integer >= 0, got {max_new!r}")
    return prompt


class _Run:
    """State shared by both loops: the target sequence (a prompt cache's, if given), output, timings."""

    def __init__(self, target: Engine, prompt: List[int], max_new: int, stop_ids: Iterable[int],
                 on_token: Optional[Callable[[int], None]],
                 on_logits: Optional[Callable[[int, np.ndarray], None]] = None,
                 cache: Optional[PrefixCache] = None):
        self.target, self.max_new, self.on_token, self.on_logits = target, max_new, on_token, on_logits
        self.n_prompt, self.cache = len(prompt), cache
        self.stops = {int(s) for s in stop_ids}
        self.t0 = time.perf_counter()
        self.context = list(prompt)            # committed tokens (the target's KV holds them once fed)
        self.seq, held = take_sequence(target, cache, prompt)     # holding prompt[:held] already
        self.res = GenResult(tokens=[], cached_tokens=held)
        self.leave_rounds = join_rounds(target)    # a shared engine's rounds wait for this generation
        try:
            target.check_room(self.seq, len(prompt) - held)
            # the whole rest of the prompt in one call (a prompt cache leaves at least one token):
            # its last row is the first token's distribution (take_first_row)
            self._first_row: Optional[np.ndarray] = self.forward(prompt[held:], "prefill", rows=1)
        except BaseException as e:
            self.abort(e)
            raise
        self.res.prefill_s = time.perf_counter() - self.t0

    def take_first_row(self) -> Optional[np.ndarray]:
        """The prefill's last row ([1, vocab]) while nothing was committed after the prompt: the
        first token comes from it, with no target call (and no draft) of its own; None after."""
        row, self._first_row = self._first_row, None
        if row is None or self.pending():
            return None                         # a grammar forced the first tokens: fed by the next call
        self.res.n_verify_calls += 1            # the prefill yielded this token
        return row

    def forward(self, tokens: List[int], kind: str = "verify", rows: int = 0) -> np.ndarray:
        """Feed tokens; the logits of the last `rows` (0: all; Engine.forward_rows)."""
        t = time.perf_counter()
        out = self.target.forward_rows(self.seq, tokens, rows)
        self.res.timings.append(CallTiming(kind, len(tokens), time.perf_counter() - t))
        if kind == "verify":
            self.res.n_verify_calls += 1
        return out

    @property
    def done(self) -> bool:
        return self.res.finish_reason != "length" or self.res.n_generated >= self.max_new

    def pending(self) -> List[int]:
        """The committed tokens the target's KV does not hold yet: the last one, and any the grammar
        forced after it (jump_forward); the next target call feeds them first."""
        return self.context[self.target.length(self.seq):]

    def room(self) -> int:
        """Tokens the target can still take (the pending ones included)."""
        room = self.target.max_len - self.target.length(self.seq)
        if room < 1:
            self.res.finish_reason = "context"
        return room

    def adjusted(self, rows: np.ndarray, params: SamplingParams, drafts: Sequence[int] = ()) -> np.ndarray:
        """A target call's rows after the penalties and logit_bias (unchanged when there are none)."""
        return adjust_logits(rows, params, self.context, self.n_prompt, drafts)

    def commit(self, tokens: List[int], rows: Optional[np.ndarray] = None) -> None:
        """Commit tokens in order; rows[i] is the (adjusted) target row tokens[i] was chosen from."""
        for i, t in enumerate(tokens):
            if t in self.stops:
                self.res.stop_token, self.res.finish_reason = t, "stop"
                return
            self.res.tokens.append(t)
            self.context.append(t)
            if self.on_logits is not None:
                self.on_logits(t, rows[i])
            if self.on_token is not None:
                self.on_token(t)
            if self.res.n_generated >= self.max_new:
                return

    def finish(self) -> GenResult:
        self.leave_rounds()
        give_back(self.target, self.cache, self.seq)
        self.res.wall_s = time.perf_counter() - self.t0
        return self.res

    def abort(self, error: BaseException) -> None:
        """Ended by `error`: the sequence back; error.gen_result is what was generated so far."""
        self.leave_rounds()
        give_back(self.target, self.cache, self.seq, error)
        self.res.wall_s, error.gen_result = time.perf_counter() - self.t0, self.res


def generate_plain(target: Engine, prompt_ids: Sequence[int], max_new: int,
                   params: SamplingParams = GREEDY, stop_ids: Iterable[int] = (),
                   on_token: Optional[Callable[[int], None]] = None,
                   on_logits: Optional[Callable[[int, np.ndarray], None]] = None,
                   grammar=None, cache: Optional[PrefixCache] = None) -> GenResult:
    """Target-only decoding, one target call per generated token. grammar: an
    edge.speculative.grammar.Grammar the output follows (its end token stops the generation);
    cache: the target's prompt cache (its sequence comes from it and goes back to it)."""
    prompt = _check_prompt(prompt_ids, max_new)
    rng = role_rng(params.seed, Role.TARGET)
    run = _Run(target, prompt, max_new, stop_ids, on_token, on_logits, cache)
    matcher = grammar_matcher(grammar, run.stops)
    try:
        while not run.done and run.room() >= 1:
            if jump_forward(run, matcher) and run.done:
                break
            rows = run.take_first_row()
            if rows is None:                 # forced tokens' rows are not needed: the last one only
                pending = run.pending()
                rows = run.forward(pending, rows=1 if len(pending) > 1 else 0)
            rows = run.adjusted(rows, params)
            if matcher is not None:
                rows = mask_rows(rows, [matcher.allowed()])
            t = pick(rows[0], params, rng)[0]
            run.res.gammas.append(0)
            run.commit([t], rows)
            if matcher is not None:
                matcher.sync(run.res.tokens)
    except BaseException as e:
        run.abort(e)
        raise
    return run.finish()


def generate_speculative(target: Engine, drafter: Drafter, prompt_ids: Sequence[int], max_new: int,
                         gamma: int, params: SamplingParams = GREEDY, stop_ids: Iterable[int] = (),
                         on_token: Optional[Callable[[int], None]] = None,
                         adaptive: bool = False,
                         on_logits: Optional[Callable[[int, np.ndarray], None]] = None,
                         grammar=None, cache: Optional[PrefixCache] = None) -> GenResult:
    """Speculative decoding: the drafter proposes, one target call verifies.

    The output has exactly the target's distribution (greedy: exactly the
    target's greedy text) whatever the drafter does. gamma is the number of
    drafted tokens per round (>= 1); with adaptive=True it is the largest
    gamma tried and each round picks one in 0..gamma from measured costs
    (edge/speculative/gamma_rounds.py keeps that bookkeeping). With a grammar the target's
    distribution is the constrained one, and stays exactly that (edge/speculative/constrained.py).
    cache: the target's prompt cache, as generate_plain's.
    """
    _check_speculative(target, drafter, gamma)
    prompt = _check_prompt(prompt_ids, max_new)
    # The draft's proposals and the target's acceptance tests must use independent
    # uniforms, or the output is no longer the target's distribution (role_rng).
    rng = role_rng(params.seed, Role.TARGET)
    draft_rng = role_rng(params.seed, Role.DRAFT)
    rounds = GammaRounds(drafter.gamma_policy(gamma) if adaptive else None, gamma)
    run = _Run(target, prompt, max_new, stop_ids, on_token, on_logits, cache)
    res = run.res
    matcher = grammar_matcher(grammar, run.stops)
    drafter.constrain(grammar, len(prompt))
    try:
        _prepare_draft(drafter, rounds, prompt, run)
        while not run.done:
            room = run.room()
            if room < 1 or (jump_forward(run, matcher) and run.done):
                break
            if _first_token(run, matcher, params, rng):
                continue
            pending = run.pending()
            asked = rounds.next_gamma()
            res.gammas.append(asked)
            # A round yields at most cap+1 tokens: never draft past max_new or the context. γ counts
            # the drafts the grammar leaves a choice at: forced ones come on top (jump_forward.py)
            cap = min(max_new - res.n_generated - 1, room - len(pending))
            g = min(asked, cap)
            drafts, qs, forced = [], [], []
            if g > 0:                                           # propose
                drafts, qs, dt = _propose(drafter, run.context, g, draft_rng, target.vocab_size,
                                          cap if matcher is not None else g)
                res.timings.append(CallTiming("draft", len(drafts), dt))
                rounds.drafted(len(run.context), len(drafts), dt)
            if matcher is not None:                             # what the grammar lets it verify
                drafts, qs, masks = legal_drafts(matcher, drafts, qs)
                drafts, qs, masks, forced = with_forced(matcher, drafts, qs, masks, g, cap)
            fed = len(run.context)                              # verify: one target call
            logits = run.adjusted(verified_rows(run, pending, drafts), params, drafts)
            if matcher is not None:
                logits = mask_rows(logits, masks)
            rounds.verified(len(pending) + len(drafts), res.timings[-1].seconds, res.n_verify_calls,
                            served_round(target))
            if params.greedy:
                n, nxt = verify_greedy(drafts, logits)
            else:
                n, nxt = verify_stochastic(drafts, qs, to_probs(logits, params), rng)
            n_free = n - sum(forced[:n])                        # accept and commit
            res.n_drafted += len(drafts) - sum(forced)
            res.n_accepted += n_free
            res.n_forced += n - n_free
            rounds.accepted(g, len(drafts) - sum(forced), n_free)
            if n < len(drafts):
                target.truncate(run.seq, fed + n)   # drop the rejected drafts' KV
            run.commit(drafts[:n] + [nxt], logits)
            if matcher is not None:
                matcher.sync(res.tokens)
            rounds.after_round(drafter, run.context, asked)
    except BaseException as e:
        run.abort(e)
        raise
    return run.finish()


def _first_token(run: _Run, matcher, params: SamplingParams, rng: np.random.Generator) -> bool:
    """Commit the first token from the prefill's own row (as generate_plain does), before any draft:
    the target's token, whatever a draft would propose. False when that row is gone (a grammar
    forced the first tokens: the next round's call feeds them)."""
    row = run.take_first_row()
    if row is None:
        return False
    row = run.adjusted(row, params)
    if matcher is not None:
        row = mask_rows(row, [matcher.allowed()])
    run.commit([pick(row[0], params, rng)[0]], row)
    if matcher is not None:
        matcher.sync(run.res.tokens)
    return True


def _check_speculative(target: Engine, drafter: Drafter, gamma: int) -> None:
    if isinstance(gamma, bool) or not isinstance(gamma, int) or gamma < 1:
        raise ValueError(f"gamma must be an integer >= 1 (drafted tokens per verification), got {gamma!r}; "
                         f"for target-only decoding use generate_plain, or adaptive=True to let the "
                         f"cost model switch speculation off")
    dv = drafter.vocab_size
    if dv is not None and dv != target.vocab_size:
        raise ValueError(f"draft and target vocabularies differ ({dv} vs {target.vocab_size} tokens); "
                         f"the draft must share the target's tokenizer")


def _prepare_draft(drafter: Drafter, rounds: GammaRounds, prompt: List[int], run: _Run) -> None:
    """Adaptive: a one-step probe prices the draft (GammaRounds.price_draft). Fixed γ: prefill the
    draft too, so its first call is not a (slow) catch-up inside a round."""
    if rounds.policy is not None:
        seconds = rounds.price_draft(drafter, prompt[-1])
        if seconds is not None:
            run.res.timings.append(CallTiming("draft_probe", 2, seconds))
        return
    t = time.perf_counter()
    if drafter.prefill(prompt):
        run.res.timings.append(CallTiming("draft_prefill", len(prompt) - 1, time.perf_counter() - t))
        run.res.prefill_s = time.perf_counter() - run.t0


def _propose(drafter: Drafter, context: List[int], g: int, rng: np.random.Generator,
             vocab_size: int, keep: int) -> Tuple[List[int], list, float]:
    """Up to `keep` drafts after `context` (g asked for, grammar-forced ones on top), the q each was
    drawn from, and the seconds the drafter took."""
    t = time.perf_counter()
    drafts, qs = drafter.draft(context, g, rng)
    dt = time.perf_counter() - t
    drafts = [int(x) for x in drafts[:keep]]
    # No q given: verify against one-hot q at each proposal. That is
    # lossless for ANY way the proposals were made (given the
    # proposals, it is exact verification of a deterministic draft).
    qs = list(qs[:keep]) if qs is not None else [SparseDist.one_hot(x) for x in drafts]
    # A drafter may propose ids the target lacks (an n-gram copying
    # a bad prompt id): drop them rather than fail the generation.
    bad = [i for i, x in enumerate(drafts) if not 0 <= x < vocab_size]
    if bad:
        drafts, qs = drafts[:bad[0]], qs[:bad[0]]
    return drafts, qs, dt
