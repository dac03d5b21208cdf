"""The adaptive γ policy of edge/speculative/generate.py: how many tokens to draft each round (0 included),
from measured costs (edge/speculative.CostTracker) and the running acceptance rate."""
from __future__ import annotations

from typing import Optional

from edge.speculative.gamma_probes import ProbeSchedule
from edge.speculative.verify import AcceptanceTracker, CostTracker, choose_gamma


class AdaptiveGamma:
    """Chooses gamma per round from measured costs and the running alpha.

    First plain steps until `warmup` single-step timings exist. Then, if
    speculation could pay at all -- choose_gamma() at an optimistic alpha
    (`explore_alpha`) with what is known of the verify cost (a prior slope
    until measured) and of the draft (a one-step probe) -- one exploration
    round at min(max_gamma, 3) measures alpha, the draft and a longer verify;
    where it cannot pay (a draft that costs ~half a target step, as on these
    CPUs) nothing is drafted at all: the run is plain decoding plus two draft
    steps. After that, choose_gamma() with the measured alpha and a `margin`
    so timing noise does not tip a near-tie into speculation. When that says
    0, a gamma=1 probe runs after 8, 16, 32 ... plain steps so the estimates
    can recover -- O(log n) probes in all, and none where even the optimistic
    alpha would not pay. While speculating, a plain step every `refresh`
    rounds (every 8 until the single-step window is full) keeps the
    single-step time -- the unit of every cost -- measured. (The probes and
    refresh steps: edge/speculative/gamma_probes.py, shared with RemoteGamma.)
    """
    background = False      # a co-located draft's probe costs the device its compute: real rounds

    def __init__(self, max_gamma: int, margin: float = 0.05, probe_start: int = 8, warmup: int = 2,
                 refresh: int = 32, acceptance: Optional[AcceptanceTracker] = None,
                 costs: Optional[CostTracker] = None, explore_alpha: float = 0.8):
        self.max_gamma = max_gamma
        self.margin = margin
        self.explore_alpha = explore_alpha
        self.warmup = warmup
        self.refresh = refresh
        self.acceptance = acceptance or AcceptanceTracker()
        self.costs = costs or CostTracker()
        self._rounds = ProbeSchedule(probe_start)

    def could_pay(self) -> bool:
        """Would speculation win at the optimistic alpha, with the costs measured so far?"""
        if not self.costs.has_draft:
            return True                       # nothing known of the draft: find out
        return choose_gamma(self.explore_alpha, self.costs.c, self.costs.verify_cost, self.max_gamma,
                            self.margin) > 0

    def next_gamma(self) -> int:
        if self.costs.samples(1) < self.warmup:
            return 0
        if self.acceptance.rounds == 0 or not self.costs.has_draft:
            return min(self.max_gamma, 3) if self.could_pay() else 0
        g = choose_gamma(self.acceptance.alpha, self.costs.c, self.costs.verify_cost,
                         self.max_gamma, self.margin)
        if g > 0:
            return self._rounds.speculating(g, self.refresh if self.costs.samples(1) >= self.costs.window else 8)
        return 1 if self._rounds.plain(self.could_pay) else 0      # a γ=1 probe where it could pay
