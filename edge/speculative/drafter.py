"""The Drafter interface: what edge.speculative.generate's speculative loop asks of a proposer.

ModelDrafter (a local draft model), NgramDrafter (prompt lookup) and RemoteDrafter
(a StarSD hub session) implement it. Each proposal comes with the exact distribution q it
was sampled from; verification is lossless whatever the proposals are (docs/architecture.md).
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import List, Optional, Sequence, Tuple

import numpy as np

from edge.speculative.local_gamma import AdaptiveGamma


class Drafter(ABC):
    name: str = "drafter"
    vocab_size: Optional[int] = None     # None: works with any vocabulary

    @abstractmethod
    def draft(self, context: Sequence[int], gamma: int,
              rng: np.random.Generator) -> Tuple[List[int], list]:
        """Up to gamma proposed tokens after `context`, and the q (SparseDist or dense
        probabilities) each was drawn from, using `rng` (the draft's own stream)."""

    def probe_step_seconds(self, token: int) -> Optional[float]:
        """Seconds one draft step costs, for the adaptive γ policy; None: not measurable here
        (the draft's cost does not land on this device, or it is free)."""
        return None

    policy = None                        # the γ policy gamma_policy() made last (what γ=auto measured)

    def gamma_policy(self, max_gamma: int):
        """The adaptive γ policy for this drafter (next_gamma(), .costs, .acceptance): by default
        edge/speculative/local_gamma.py's, which prices the draft by its compute on this device.
        It stays as `policy` after the run (edge/speculative/speedup_note.py reads its estimates)."""
        self.policy = AdaptiveGamma(max_gamma)
        return self.policy

    def observe(self, context: Sequence[int], gamma: int) -> Optional[Tuple[int, int]]:
        """At a plain step of adaptive γ: ask for `gamma` drafts after `context` in the background
        (0: ask nothing), without waiting. Returns (drafted, accepted) once an earlier background
        answer can be scored against the tokens the target decoded itself, else None. By default
        a drafter cannot probe in the background (its policy probes with real rounds)."""
        return None

    def constrain(self, grammar, start: int) -> None:
        """Propose under `grammar` (an edge.speculative.grammar.Grammar; None: unconstrained) for the
        generated part of the context, from position `start` on. By default a drafter proposes
        freely: the loop keeps the legal prefix of its proposals (still lossless, fewer accepted)."""

    def prefill(self, prompt: Sequence[int]) -> bool:
        """Get ready for `prompt` before the first round; True if that cost time worth timing."""
        return False

    def close(self) -> None:
        """Release what the drafter holds."""
