"""γ's bookkeeping in the speculative loop (edge/speculative/generate.py): the γ each round asks for, and
what an adaptive policy (local_gamma.py, remote_gamma.py) learns from each round -- the draft's and
the target's call times, the acceptance, background probes. With a fixed γ there is no policy and
every method but next_gamma() does nothing. None of it touches what the target verifies."""
from __future__ import annotations

import time
from typing import Optional, Sequence

CATCH_UP_OK = 4   # a draft call feeding <= this many missed tokens still times as a step


class GammaRounds:
    def __init__(self, policy, gamma: int):
        """policy: the drafter's gamma_policy() (adaptive γ) or None (every round asks `gamma`)."""
        self.policy, self.gamma = policy, gamma
        # Context length the drafter last saw. A draft call after many plain
        # steps also feeds the tokens it missed: not a fair draft-step sample.
        self._seen = 0

    def price_draft(self, drafter, token: int) -> Optional[float]:
        """Adaptive: price the draft by a one-step probe rather than a prefill (it catches up only if
        a round drafts, which it may never do: a target whose verify calls cost ~k steps). The
        seconds the probe took, or None when there was none."""
        if self.policy is None:
            return None
        t = time.perf_counter()
        probe = drafter.probe_step_seconds(token)
        if probe is None:
            return None
        self.policy.costs.add_draft(1, probe)
        return time.perf_counter() - t

    def next_gamma(self) -> int:
        return self.policy.next_gamma() if self.policy is not None else self.gamma

    def drafted(self, context_len: int, n_drafts: int, seconds: float) -> None:
        """A draft call over a context of `context_len` tokens proposed `n_drafts` in `seconds`."""
        if self.policy is not None and context_len - self._seen <= CATCH_UP_OK:
            self.policy.costs.add_draft(n_drafts, seconds)
        self._seen = context_len

    def verified(self, n_tokens: int, seconds: float, n_verify_calls: int, served: Optional[tuple] = None) -> None:
        """A target call over `n_tokens` took `seconds` (the `n_verify_calls`-th of the generation);
        served: (rows, seconds) of the whole round that served it on a shared engine (batched_calls.py)."""
        # (The target's prefill is no verify-cost sample, nor is the first call: they pay warm-up
        # costs, hundreds of ms on a GPU, which would forbid speculation exactly where it pays.)
        if self.policy is not None and n_verify_calls > 1:
            if served is not None and getattr(self.policy, "prices_shared_rounds", False):
                self.policy.shared_round(n_tokens, served[0])
                n_tokens, seconds = served        # the round's cost by all its rows, not this call's wait in it
            self.policy.costs.add_target(n_tokens, seconds)

    def accepted(self, asked: int, n_drafts: int, n_accepted: int) -> None:
        if self.policy is not None and n_drafts:
            # drafts asked for and not sent (a remote service unsure of them: --draft-p-min)
            # failed as far as the yield of asking `asked` goes; a round with no drafts at all is
            # the round-trip model's to count (RoundTrips.answered)
            self.policy.acceptance.update(max(asked, n_drafts), n_accepted)

    def after_round(self, drafter, context: Sequence[int], gamma: int) -> None:
        """After a plain step (γ 0) of a policy that probes in the background: ask the drafter for
        the probe due, and score the one it answered against what the target decoded itself."""
        if self.policy is not None and self.policy.background and gamma == 0:
            scored = drafter.observe(context, self.policy.probe)   # never waits
            if scored is not None:
                self.policy.observed(*scored)
