"""The round schedule both adaptive γ policies share (local_gamma.AdaptiveGamma, a co-located draft;
remote_gamma.RemoteGamma, a draft behind the hub): once the policy has chosen γ from its cost
model, what this round really asks for.

While γ > 0 (speculation pays) a plain step every `every` rounds keeps the target's single-step
time -- the unit of every cost -- measured. While γ = 0 it counts the plain steps and, after
`probe_start` of them, then at growing intervals, says a probe is due: a short round that
re-measures the acceptance (and the wait) so the policy can recover. The interval doubles after
each probe (at most `max_interval`) while speculation could pay at an optimistic α, and grows
`quiet_growth`-fold where not even that pays, so a machine where it never pays loses almost
nothing. Any round that speculates starts the count over.

Pure: fed with the policy's choices, reads no clock.
"""
from __future__ import annotations

import math
from typing import Callable, Optional


class ProbeSchedule:
    def __init__(self, probe_start: int, max_interval: float = math.inf, quiet_growth: int = 2):
        self.probe_start, self.max_interval, self.quiet_growth = probe_start, max_interval, quiet_growth
        self._interval = probe_start      # plain steps until the next probe
        self._zeros = 0                   # plain steps since the last probe (or speculating round)
        self._since_plain = 0             # speculating rounds since the last refresh step

    def speculating(self, gamma: int, every: int) -> int:
        """A round where γ = gamma >= 1 pays: gamma, or 0 when a refresh plain step is due (after
        `every` speculating rounds). Resets the probe count."""
        self._zeros, self._interval = 0, self.probe_start
        self._since_plain += 1
        if self._since_plain > every:
            self._since_plain = 0
            return 0
        return gamma

    def plain(self, pays: Callable[[], bool]) -> Optional[bool]:
        """A round where γ = 0 pays: None while no probe is due; when one is, whether speculation
        could pay at an optimistic α (`pays()`, asked only then), the interval grown by it."""
        self._since_plain = 0
        self._zeros += 1
        if self._zeros < self._interval:
            return None
        could = pays()
        self._zeros = 0
        self._interval = min(self._interval * 2, self.max_interval) if could else self._interval * self.quiet_growth
        return could
