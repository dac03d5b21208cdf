"""γ=auto for a drafting device (the reverse star): how many tokens to draft before each round trip.

A round costs γ local draft steps plus one round trip to the hub, whose time R(k) holds the network,
the wait for the hub's batch and its verify over k = γ+1 tokens; it yields E(α, γ) tokens. So the
pure cost model of edge/speculative/verify.py applies as it is, with the round trip in the place
of the target's call: `CostTracker.add_target(k, round trip)`, `add_draft(n, seconds)`, and
`choose_gamma(α, c, v, max)` where c is a draft step and v(k) a round trip over k tokens, both in
round trips over one token. γ=0 (the hub decodes one token a round trip) is a valid choice: it is
still the target's output, only slower. Reads no clock; fed with seconds.
"""
from __future__ import annotations

import math

from edge.speculative.verify import AcceptanceTracker, CostTracker, choose_gamma

PROBE_EVERY = 16          # at γ 0, every 16th round drafts one token


class ReverseGamma:
    """Each round's γ in 0..max_gamma from the measured round trips, draft steps and acceptance."""

    def __init__(self, max_gamma: int, first: int = 4, margin: float = 0.05):
        self.max_gamma, self.margin = max_gamma, margin
        self.first = min(first, max_gamma)
        self.costs = CostTracker(window=32, prior_slope=0.05)   # a round trip grows slowly with k
        self.acceptance = AcceptanceTracker()
        self.history: list = []

    def next_gamma(self) -> int:
        c = self.costs.c
        if not self.costs.has_draft or math.isnan(c):
            g = self.first                                # nothing measured yet
        else:
            g = choose_gamma(self.acceptance.alpha, c, self.costs.verify_cost, self.max_gamma, self.margin)
            if g == 0 and len(self.history) % PROBE_EVERY == PROBE_EVERY - 1:
                g = 1                                     # a probe: acceptance is learnt only by drafting
        self.history.append(g)
        return g

    def drafted(self, n: int, seconds: float) -> None:
        self.costs.add_draft(n, seconds)

    def answered(self, drafted: int, accepted: int, round_trip_s: float) -> None:
        self.costs.add_target(drafted + 1, round_trip_s)
        self.acceptance.update(drafted, accepted)
