"""Local generation loops over the Engine interface: target-only and speculative.

Both loops feed the prompt minus its last token as prefill and then make
every generated token come out of a target call over [pending, drafts...], so
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
from typing import Callable, Iterable, List, Optional, Sequence, Tuple, Union

import numpy as np

from edge.speculative.common_prefix import common_prefix
from edge.speculative.constrained import ConstrainedProposer, grammar_matcher, legal_drafts, mask_rows
from edge.speculative.drafter import Drafter
from edge.speculative.gamma_rounds import GammaRounds
from edge.speculative.gen_result import CallTiming, GenResult
from edge.speculative.jump_forward import FORCED_EXTRA, jump_forward, verified_rows, with_forced
from edge.speculative.prefix_cache import PrefixCache, give_back, take_sequence
from edge.engines.base import Engine
from edge.engines.batched_calls import join_rounds
from edge.speculative.sampling import (GREEDY, Role, SamplingParams, SparseDist, adjust_logits, pick, role_rng,
                                to_probs)
from edge.speculative.verify import verify_greedy, verify_stochastic


class ModelDrafter(Drafter):
    """A draft Engine kept in step with the committed tokens.

    Each call truncates the draft's sequence to its common prefix with the
    context, feeds what is missing and drafts gamma tokens, returning with
    each the exact distribution it was sampled from. With top_k > 0 (and
    temperature > 0) it samples from the renormalised top-k truncation and
    returns that SparseDist — still exactly lossless (docs/architecture.md).
    """

    def __init__(self, engine: Engine, params: SamplingParams = GREEDY, top_k: int = 0):
        if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 0:
            raise ValueError(f"draft top_k must be an integer >= 0 (0 = full distribution), got {top_k!r}")
        self.engine = engine
        self.params = params
        self.top_k = top_k
        self.vocab_size = engine.vocab_size
        self.name = f"model:{engine.fingerprint or engine.name}"
        self._seq: Optional[int] = None
        self._fed: List[int] = []
        self._proposer: Optional[ConstrainedProposer] = None   # the grammar its proposals follow

    def constrain(self, grammar, start: int) -> None:
        """Propose under `grammar` (edge/speculative/constrained.py) from context position `start` on."""
        self._proposer = None if grammar is None else ConstrainedProposer(grammar, start)

    def _pick(self, logits: np.ndarray, rng: np.random.Generator) -> Tuple[int, Union[np.ndarray, SparseDist]]:
        x, q = pick(logits, self.params, rng, self.top_k)
        return x, (SparseDist.one_hot(x) if q is None else q)

    def _sync(self, tokens: List[int]) -> np.ndarray:
        """Make the draft's sequence hold exactly `tokens` (keeping the common
        prefix, refeeding at least one token); the logits after the last one."""
        eng = self.engine
        if self._seq is None:
            self._seq = eng.new_sequence()
            self._fed = []
        keep = min(common_prefix(self._fed, tokens), len(tokens) - 1)
        if eng.length(self._seq) != keep:
            eng.truncate(self._seq, keep)
        self._fed = self._fed[:keep]          # stays true even if forward fails
        logits = eng.forward_last(self._seq, tokens[keep:])[-1]
        self._fed = list(tokens)
        return logits

    def draft(self, context: Sequence[int], gamma: int,
              rng: np.random.Generator) -> Tuple[List[int], list]:
        eng = self.engine
        context = [int(t) for t in context]
        # A draft with a shorter context drafts less, or nothing: speculation
        # never decides correctness, the target just decodes alone.
        limit = min(gamma + FORCED_EXTRA, eng.max_len - len(context) + 1)   # forced ones included
        gamma = min(gamma, limit)
        if gamma <= 0 or not context:
            return [], []
        logits = self._sync(context)
        grammar = self._proposer
        if grammar is not None and not grammar.begin(context):
            return [], []
        tokens, qs, free = [], [], 0
        try:
            while free < gamma and len(tokens) < limit:
                if grammar is not None:          # q is then the masked, renormalised q
                    logits = grammar.mask(logits)
                x, q = self._pick(logits, rng)
                tokens.append(x)
                qs.append(q)
                free += 1
                if grammar is not None and not grammar.advance(x):
                    break                        # the grammar ended here: nothing follows
                # the stretch the grammar forces next: proposed as it is, fed with x in one call
                run = grammar.forced(limit - len(tokens)) if grammar is not None else []
                tokens += run
                qs += [SparseDist.one_hot(t) for t in run]
                if free < gamma and len(tokens) < limit:
                    logits = eng.forward(self._seq, [x] + run)[-1]
                    self._fed += [x] + run
        finally:
            if grammar is not None:
                grammar.end()
        return tokens, qs

    def probe_step_seconds(self, token: int) -> float:
        """Seconds of one draft step, measured on a scratch sequence (the second of two calls:
        the first pays one-off costs). A draft-cost sample that needs no prefill."""
        eng = self.engine
        secs = 0.0
        for _ in range(2):
            seq = eng.new_sequence()
            try:
                t = time.perf_counter()
                eng.forward_last(seq, [int(token)])
                secs = time.perf_counter() - t
            finally:
                eng.free(seq)
        return secs

    def prefill(self, prompt: Sequence[int]) -> bool:
        """Feed all but the last prompt token (what draft() would feed anyway)."""
        prompt = [int(t) for t in prompt]
        if 1 < len(prompt) <= self.engine.max_len:
            self._sync(prompt[:-1])
            return True
        return False

    def close(self) -> None:
        """Free the draft's sequence (a later draft() starts a fresh one)."""
        if self._seq is not None:
            self.engine.free(self._seq)
        self._seq, self._fed = None, []


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
        self.context = list(prompt)            # committed tokens; the last one (at least) not yet fed
        self.seq, held = take_sequence(target, cache, prompt)     # holding prompt[:held] already
        self.res = GenResult(tokens=[], cached_tokens=held)
        self.leave_rounds = join_rounds(target)    # a shared engine's rounds wait for this generation
        try:
            target.check_room(self.seq, len(prompt) - held)
            if len(prompt) - 1 > held:
                self.forward(prompt[held:-1], "prefill")
        except BaseException as e:
            self.abort(e)
            raise
        self.res.prefill_s = time.perf_counter() - self.t0

    def forward(self, tokens: List[int], kind: str = "verify", rows: int = 0) -> np.ndarray:
        """Feed tokens; the logits of the last `rows` (0: all; Engine.forward_rows)."""
        t = time.perf_counter()
        # a prefill's logits are thrown away (the last prompt token is fed by the first step)
        out = self.target.forward_rows(self.seq, tokens, 1 if kind == "prefill" else rows)
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
            pending = run.pending()          # forced tokens' rows are not needed: the last one only
            rows = run.adjusted(run.forward(pending, rows=1 if len(pending) > 1 else 0), params)
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
            rounds.verified(len(pending) + len(drafts), res.timings[-1].seconds, res.n_verify_calls)
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
