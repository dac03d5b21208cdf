"""Adaptive γ for a draft behind the hub (StarSD): how many tokens to ask for each round, 0 included.

The co-located policy (edge/speculative/local_gamma.py) prices the draft by its compute, which lands on the
device. A remote draft's compute does not; what the target pays is the wait for the answer
-- the round trip as it sees it, the draft service's queueing and drafting included. So a
round of γ drafts costs, in target single-step units,

    cost(γ) = v(γ+1) + W(γ)/t1      (γ >= 1),        cost(0) = 1 (a plain step, no request)

with v(k) the target's measured verify cost over k tokens (CostTracker), t1 its single step
and W(γ) = o + d·γ the wait: o the part that does not grow with γ (network, broker, the
target's own bookkeeping), d the draft service's seconds per drafted token, both measured
from its answers (DraftResponse.compute_us splits a round trip into the two). γ maximises
expected_tokens(α, γ)/cost(γ) over 0..max_gamma with the running acceptance α.

Pure: fed with seconds, reads no clock (edge/star/target.py's RemoteDrafter feeds it).
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Mapping, Optional

import numpy as np

from edge.speculative.gamma_probes import ProbeSchedule
from edge.speculative.verify import AcceptanceTracker, CostTracker, expected_tokens


def best_gamma(alpha: float, round_cost: Callable[[int], float], max_gamma: int, margin: float = 0.0,
               answered: float = 1.0, others: float = 0.0) -> int:
    """The γ in 0..max_gamma with the best expected tokens per unit of round cost; 0 unless some
    γ >= 1 beats plain decoding (round_cost(0)) by more than `margin` (relative). `answered`: the
    share of requests answered in time (an unanswered round yields the one plain token). `others`:
    tokens the other generations sharing the round (batched) commit in it, whatever this one asks;
    round_cost then prices the whole round, their rows included."""
    if max_gamma < 0:
        raise ValueError(f"max_gamma must be >= 0, got {max_gamma!r}")
    best, best_s = 0, (1.0 + margin) * (others + 1.0) / round_cost(0)
    for g in range(1, max_gamma + 1):
        s = (others + answered * expected_tokens(alpha, g) + 1.0 - answered) / round_cost(g)
        if s > best_s:
            best, best_s = g, s
    return best


@dataclass
class Wait:
    gamma: int                       # drafts asked for
    wall_s: float                    # the target's time inside the round's draft call
    compute_s: Optional[float]       # the service's time on it (None: no answer, or an error)
    tokens: int = 0                  # drafts answered
    short: bool = True               # the request fed a few tokens (not a prompt or a catch-up)


class RoundTrips:
    """The wait W(γ) a target sees for a remote draft, from its last `window` rounds.

    A draft service that drafts ahead (edge-agent run's default) has the next answer ready when
    the target accepted every draft and its bonus token is the draft's own next one: a hit,
    answered at once. Otherwise (a miss) it drafts γ tokens fresh. So

        W(γ) = o + (c + b·γ)·(1 − h·α^(γ+1))

    A miss's compute is a fixed part c (the service feeds the target's new tokens: one forward
    pass of the draft) and b per drafted token: a line through the median compute at each
    drafted-token count of the answered short-feed misses (a long feed -- a catch-up after plain
    steps -- also paid a prefill; a hit, compute/tokens under a quarter of the window's largest,
    is no sample of it). Until two counts are seen, or when the line says c < 0 or b <= 0, c = 0
    and b = d, the median compute/tokens (which, from γ=1 rounds alone, prices a γ=3 round at
    3 feeds: deeper γ looks dearer than it is). d also sizes the deadline (per_token_s).
    h: the hits seen over the hits α^(γ+1) predicts for
    the rounds in the window, (1 + seen) / (1 + predicted) at most 1, so a service that does not
    draft ahead soon counts as one. Without α (wait_s(γ)) no hits are assumed. o: median of
    wall − compute (an unanswered round: wall − d·γ, the time it waited in vain), never below 0.

    A service with a confidence stop (--draft-p-min) sends s <= γ drafts. sent_shares(γ) says how
    many: each sent draft after the first is followed by another with probability q (a geometric
    run, censored at the γ asked), q = (continues + 1) / (continues + stops + 1) over the answered
    rounds -- 1 (all γ sent) until a stop is seen. The compute part of a miss is then priced at the
    drafts expected to be sent, and a hit needs those, not γ, accepted."""

    HIT = 0.25                         # compute/tokens under this share of the window's largest: a hit

    def __init__(self, window: int = 16):
        self._rounds: deque = deque(maxlen=window)
        self._stats: Optional[tuple] = None     # cached (o, d, hits, c, b, q): the policy asks for every γ each round

    def add(self, w: Wait) -> None:
        if w.gamma < 1 or w.wall_s < 0:
            raise ValueError(f"a round trip needs gamma >= 1 and wall_s >= 0, got {w}")
        self._rounds.append(w)
        self._stats = None

    @property
    def samples(self) -> int:
        return len(self._rounds)

    @property
    def answered(self) -> float:
        """Share of the recorded requests answered in time with at least one draft (1.0 with none
        recorded). An answer without drafts (the service unsure of its first one: --draft-p-min)
        is a round like an unanswered one: the target waited and decodes its plain token."""
        n = len(self._rounds)
        return sum(w.compute_s is not None and w.tokens > 0 for w in self._rounds) / n if n else 1.0

    def _rates(self) -> list:
        """(γ, drafts answered, compute seconds, compute/drafts) of the answered short-feed rounds."""
        return [(w.gamma, w.tokens, w.compute_s, w.compute_s / w.tokens) for w in self._rounds
                if w.compute_s is not None and w.tokens and w.short]

    @property
    def per_token_s(self) -> float:
        return self._cached()[1]

    @property
    def overhead_s(self) -> float:
        return self._cached()[0]

    def _cached(self) -> tuple:
        if self._stats is None:
            rates = self._rates()
            top = max((r for *_, r in rates), default=0.0)
            misses = [r for *_, r in rates if r >= self.HIT * top]
            d = float(np.median(misses)) if misses else 0.0
            xs = [w.wall_s - (w.compute_s if w.compute_s is not None else d * w.gamma) for w in self._rounds]
            o = max(0.0, float(np.median(xs))) if xs else 0.0
            c, b = self._line([(t, s) for _, t, s, r in rates if r >= self.HIT * top], d)
            self._stats = (o, d, [(g, r < self.HIT * top) for g, _, _, r in rates], c, b, self._continue_share())
        return self._stats

    def _continue_share(self) -> float:
        """q: after a sent draft, the share of times the service sent the next one too (it had
        been asked for it). Answers with drafts only; a count past the γ asked (a draft-ahead
        chain) is no stop."""
        cont = stops = 0
        for w in self._rounds:
            if w.compute_s is not None and w.tokens > 0:
                s = min(w.tokens, w.gamma)
                cont += s - 1
                stops += s < w.gamma
        return (cont + 1.0) / (cont + stops + 1.0)

    def sent_shares(self, gamma: int) -> list:
        """[(s, P(s drafts sent | γ asked, at least one sent))] for s = 1..γ (see the class doc)."""
        q = self._cached()[5]
        if gamma < 1:
            return []
        if q >= 1.0:
            return [(gamma, 1.0)]
        return [(s, q ** (s - 1) * (1.0 - q)) for s in range(1, gamma)] + [(gamma, q ** (gamma - 1))]

    @property
    def continue_share(self) -> float:
        return self._cached()[5]

    @staticmethod
    def _line(samples: list, d: float) -> tuple:
        """(c, b): compute = c + b·drafts through the median compute per drafted-token count
        (medians: one slow answer does not tilt it), weighted by how often each count was seen."""
        by: dict = {}
        for t, s in samples:
            by.setdefault(t, []).append(s)
        if len(by) < 2:
            return 0.0, d
        ts = sorted(by)
        b, c = np.polyfit(ts, [np.median(by[t]) for t in ts], 1, w=np.sqrt([len(by[t]) for t in ts]))
        return (float(c), float(b)) if c >= 0 and b > 0 else (0.0, d)

    @property
    def per_draft_s(self) -> float:
        """b: a miss's compute per drafted token (the line's slope, else d)."""
        return self._cached()[4]

    @property
    def fixed_s(self) -> float:
        """c: a miss's compute that does not grow with γ (0 until two drafted-token counts are seen)."""
        return self._cached()[3]

    def hit_share(self, alpha: float, gamma: int, sent: bool = True) -> float:
        """Expected share of rounds of `gamma` drafts asked the service answers from its ahead
        chain: every sent draft and the bonus token kept (sent=False: all γ as if sent)."""
        hits = self._cached()[2]
        seen, predicted = sum(h for _, h in hits), sum(alpha ** (g + 1) for g, _ in hits)
        shares = self.sent_shares(gamma) if sent else [(gamma, 1.0)]
        return min(1.0, (1.0 + seen) / (1.0 + predicted)) * sum(p * alpha ** (s + 1) for s, p in shares)

    def wait_s(self, gamma: int, alpha: Optional[float] = None, sent: bool = True) -> float:
        """W(γ) in seconds; sent=False prices γ drafts sent whatever the service's stop did."""
        if gamma < 1:
            return 0.0
        o, _, _, c, b, _ = self._cached()
        miss = 1.0 if alpha is None else 1.0 - self.hit_share(alpha, gamma, sent)
        drafted = sum(s * p for s, p in self.sent_shares(gamma)) if sent else gamma
        return o + (c + b * drafted) * miss


@dataclass(frozen=True)
class GammaPricing:
    """What a StarSD target's γ=auto starts from, in one place: StarTarget hands it to its
    RemoteDrafter, whose gamma_policy() builds the RemoteGamma from it and the waits it measures.

    verify_costs: {k: seconds of a target call over k tokens} measured beforehand
    (edge/speculative/verify_costs.py), seeding the cost model (empty: measured as it goes).
    stop_aware: RemoteGamma's; False is the pricing before the confidence stop's sent count was
    priced, kept for the A/B runs that set it side by side (`--gammas auto-asked`). sharing:
    RemoteGamma's (edge/engines/batched_calls.py's sharing_of on a shared engine)."""
    verify_costs: Mapping[int, float] = field(default_factory=dict)
    stop_aware: bool = True
    sharing: Optional[Callable[[], int]] = None     # generations sharing the target's rounds now (None: 1)

    def cost_tracker(self) -> CostTracker:
        costs = CostTracker()
        for k, seconds in sorted(self.verify_costs.items()):
            costs.add_target(k, seconds)
        return costs


class RemoteGamma:
    """γ per round for a RemoteDrafter; the loop of edge/speculative/generate.py feeds `costs` (target calls)
    and `acceptance`, the drafter feeds `waits`.

    It opens with `explore` rounds at γ=`first_gamma` (the answer to the primed first request is
    already on its way) and one plain step, so α, W, v(2) and t1 are all measured; γ=1 unless the
    verify-cost curve is seeded, because where a verify over k tokens costs ~k steps (CPUs) each
    longer exploring round would cost the target steps it never wins back. Then γ from best_gamma()
    with the measured α (v(k) beyond the measured k extrapolated along the last slope) and a
    `margin` so noise does not tip a near-tie into speculation. At γ=0 the session stays joined and
    nothing is sent; a γ=1 probe after `probe_start` plain steps, then at doubling intervals (at
    most `max_interval` apart while speculation could pay at an optimistic α; x4 each time where not
    even that pays, so a machine where it never pays loses almost nothing) re-measures α and W so it
    can recover. With `background` (a drafter that can probe without the target waiting: greedy
    through the star) the probe is not a round: next_gamma() stays 0 and `probe` says how many
    drafts to ask for in the background; `observed()` then feeds what they would have accepted, so a
    prompt where the draft agrees little costs the target nothing to keep measuring.
    While speculating, a plain step every `refresh` rounds keeps t1 measured. (The probes and
    refresh steps: edge/speculative/gamma_probes.py, shared with AdaptiveGamma.)

    Shared rounds (`sharing`: N generations on one engine, their forwards one call a round,
    edge/engines/batched_calls.py): the costs are fed with what whole rounds cost by all their rows
    (prices_shared_rounds), and γ is chosen for the whole round's rate: the other generations put
    R rows in it (the median of the last rounds that served this one, at least N-1) and commit N-1
    tokens, so a round of γ costs v(R+γ+1) + W/t1 for N-1 + E(γ) tokens against v(R+1) for N
    (a wait for drafts holds the round for everyone). Priced as if alone, a round of 4 verifying 5
    rows each looked like 5 rows of 1 while it cost the engine 20: where a row costs a slice of a
    step (a CPU's compute-bound batch) each generation drafted deep and the batch slowed below
    plain batched decoding; priced shared, γ falls to 0 there by itself.
    """

    prices_shared_rounds = True        # GammaRounds feeds whole shared rounds' costs (rows, seconds)

    MAX_P_MIN = 0.95                  # the strictest stop a target asks for

    def __init__(self, max_gamma: int, waits: Optional[RoundTrips] = None, margin: float = 0.05,
                 explore: int = 2, explore_gamma: int = 1, probe_start: int = 16, max_interval: int = 64,
                 refresh: int = 32, explore_alpha: float = 0.8, acceptance: Optional[AcceptanceTracker] = None,
                 costs: Optional[CostTracker] = None, background: bool = False, probe_gamma: int = 4,
                 stop_aware: bool = True, sharing: Optional[Callable[[], int]] = None):
        if max_gamma < 1:
            raise ValueError(f"max_gamma must be >= 1 for adaptive γ, got {max_gamma!r}")
        self.max_gamma, self.margin, self.explore_alpha = max_gamma, margin, explore_alpha
        self.explore, self.explore_gamma = explore, explore_gamma
        self.refresh = refresh
        self.waits = waits if waits is not None else RoundTrips()
        self.acceptance = acceptance or AcceptanceTracker()
        self.costs = costs or CostTracker()
        self._asked = 0
        self._rounds = ProbeSchedule(probe_start, max_interval, quiet_growth=4)
        self.background, self.probe_gamma = background, min(max_gamma, probe_gamma)
        # stop_aware: price a round by the drafts the service sends and ask for the confidence stop
        # that suits this target (p_min()); False: as if all γ asked were sent, and the service's
        # own stop (the older model, for A/B runs)
        self.stop_aware = stop_aware
        self.probe = 0                    # drafts a background probe asks for now (0: none due)
        self.sharing = sharing
        self._other_rows: deque = deque(maxlen=8)     # rows the others put in the rounds that served this one

    @property
    def first_gamma(self) -> int:
        """γ of the exploring rounds: with the verify-cost curve measured (seeded), the γ that would
        pay best at the optimistic α with no wait -- deep on a memory-bound target, where a verify
        over k tokens costs far less than k steps; else `explore_gamma`. 0 on rounds shared with
        other generations where probes go in the background (greedy): an exploring round would hold
        theirs while it waits for drafts, and a primed request keeps the draft's core busy (on two
        cores that slowed the target's batched steps ~15%, measured); background probes measure α and
        the wait at no cost to the round."""
        if self.background and self.others()[1] > 0:
            return 0
        g = min(self.max_gamma, self.explore_gamma)
        if self.costs.samples(g + 2) == 0:
            return g
        rows, others = self.others()
        deep = best_gamma(self.explore_alpha, lambda k: self.costs.verify_cost(rows + k + 1), self.max_gamma,
                          self.margin, others=others)
        return max(g, deep)

    def shared_round(self, own_rows: int, round_rows: int) -> None:
        """A round on a shared engine served this generation's `own_rows` among `round_rows` in all.
        Past what the others could verify at max_gamma it held a prompt's prefill: not a sample (a
        round or two of those at the start priced the next rounds' drafts as nearly free)."""
        others = max(0, int(round_rows) - int(own_rows))
        n = max(1, int(self.sharing())) if self.sharing is not None else 1
        if others <= (n - 1) * (self.max_gamma + 1):
            self._other_rows.append(others)

    def others(self) -> tuple:
        """(rows, tokens) the other generations sharing the round put in it: (0, 0) alone."""
        n = max(1, int(self.sharing())) if self.sharing is not None else 1
        if n == 1:
            return 0, 0
        seen = float(np.median(self._other_rows)) if self._other_rows else 0.0
        return max(float(n - 1), seen), n - 1

    def round_cost(self, gamma: int, alpha: Optional[float] = None) -> float:
        """Target single steps one round of `gamma` drafts asked costs (measured, or priors): a
        verify over the drafts the service is expected to send, plus one (RoundTrips.sent_shares:
        a service with a confidence stop sends fewer on uncertain text, so asking deep costs less
        there than a verify over γ+1); a request not answered in time costs its wait and a plain
        step. With α: the wait as it is when the service drafts ahead (RoundTrips.wait_s).
        Expected tokens need no such care: α counts a draft asked for and not sent as rejected."""
        rows = self.others()[0]             # a shared round's other rows: its whole cost
        if gamma < 1:
            return self.costs.verify_cost(rows + 1)
        p = self.waits.answered
        shares = self.waits.sent_shares(gamma) if self.stop_aware else [(gamma, 1.0)]
        verify = sum(q * self.costs.verify_cost(rows + s + 1) for s, q in shares)
        v = p * verify + (1.0 - p) * self.costs.verify_cost(rows + 1)
        t1 = self.costs.target_seconds(1)
        return v + (self.waits.wait_s(gamma, alpha, self.stop_aware) / t1 if t1 else 0.0)

    def p_min(self) -> Optional[float]:
        """The confidence stop this target asks the service for (DraftRequest.p_min, used where looser
        than the service's --draft-p-min; None: the service's). A draft the service gives
        probability p adds at most p tokens to a round and costs the verify's marginal step Δv (the
        mean slope of v(k) over k = 2..max_gamma+1) plus its compute b/t1 while the target waits.
        Adding it beats the round's rate R (tokens a step, of the γ best now; 1 when plain decoding
        is, alone; on a shared round its rate and Δv over the others' rows, as round_cost prices
        it) when p > R·(Δv + b/t1): that is the stop, capped at MAX_P_MIN. Where a verify over k
        tokens costs ~k steps it is ~1 (few drafts pay); a memory-bound target, Δv ≈ 0, takes the
        unsure drafts too, which a service-wide stop set for the other kind would withhold."""
        t1 = self.costs.target_seconds(1)
        if not self.stop_aware or not t1 or self.costs.samples(2) == 0:
            return None
        top = self.max_gamma + 1
        alpha = self.acceptance.alpha
        g = self.choose(alpha)
        rows, others = self.others()
        v = self.costs.verify_cost
        dv = max(0.0, (v(rows + top) - v(rows + 2)) / (top - 2)) if top > 2 else max(0.0, v(rows + 2) - v(rows + 1))
        p = self.waits.answered
        plain = (others + 1.0) / v(rows + 1)  # 1 alone; shared, the whole round's tokens over its cost
        rate = (others + p * expected_tokens(alpha, g) + 1.0 - p) / self.round_cost(g, alpha) if g else plain
        return min(self.MAX_P_MIN, max(plain, rate) * (dv + self.waits.per_draft_s / t1))

    def choose(self, alpha: float) -> int:
        return best_gamma(alpha, lambda g: self.round_cost(g, alpha), self.max_gamma, self.margin,
                          self.waits.answered, self.others()[1])

    def could_pay(self) -> bool:
        """Would speculation win at the optimistic α, with the waits and costs measured so far?"""
        return self.choose(self.explore_alpha) > 0

    def next_gamma(self) -> int:
        self.probe = 0
        g = self._next()
        self._asked += g > 0
        return g

    def observed(self, drafted: int, accepted: int) -> None:
        """A background probe's drafts scored against the tokens the target decoded itself."""
        self.acceptance.update(drafted, accepted)

    def _next(self) -> int:
        if self.waits.samples == 0 or (self.acceptance.rounds < self.explore and self._asked < 2 * self.explore):
            g = self.first_gamma              # an unready drafter answers at once: asking costs nothing
            if g > 0:
                return g
            if self._rounds.plain(lambda: True) is not None:    # shared rounds: probes in the background
                self.probe = self.probe_gamma
            return 0
        if self.costs.samples(1) == 0:
            return 0                          # the unit of every cost
        g = self.choose(self.acceptance.alpha)
        if g > 0:
            return self._rounds.speculating(g, self.refresh if self.costs.samples(1) >= 4 else 8)
        if self._rounds.plain(self.could_pay) is None:
            return 0
        if self.background:                   # a probe due: in the background, or a γ=1 round
            self.probe = self.probe_gamma
            return 0
        return 1
