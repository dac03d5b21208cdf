"""What a generation loop hands back (edge/speculative/generate.py): the tokens, why it ended,
and what it cost (target calls, drafts, forced tokens, timings)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional


@dataclass
class CallTiming:
    kind: str          # "prefill", "verify" (a target call, plain steps included) or "draft"
    n_tokens: int      # tokens fed (prefill/verify) or drafted (draft)
    seconds: float


@dataclass
class GenResult:
    tokens: List[int]                 # generated ids, stop token excluded
    stop_token: Optional[int] = None  # the stop id that ended generation, if any
    finish_reason: str = "length"     # "length" (max_new), "stop", or "context" (context full)
    n_verify_calls: int = 0           # target calls after prefill
    n_drafted: int = 0
    n_accepted: int = 0
    n_forced: int = 0                 # tokens a grammar forced, committed without a call of their own
    wall_s: float = 0.0
    prefill_s: float = 0.0
    timings: List[CallTiming] = field(default_factory=list)
    gammas: List[int] = field(default_factory=list)   # gamma asked for, per round
    cached_tokens: int = 0            # prompt tokens whose KV a prompt cache held (not prefilled)

    @property
    def n_generated(self) -> int:
        return len(self.tokens) + (self.stop_token is not None)

    @property
    def acceptance_rate(self) -> float:
        """Accepted / drafted (0.0 when nothing was drafted)."""
        return self.n_accepted / self.n_drafted if self.n_drafted else 0.0

    @property
    def tokens_per_verify(self) -> float:
        return self.n_generated / self.n_verify_calls if self.n_verify_calls else 0.0

    @property
    def decode_s(self) -> float:
        return self.wall_s - self.prefill_s

    @property
    def tokens_per_s(self) -> float:
        """Decode throughput (prefill excluded)."""
        return self.n_generated / self.decode_s if self.decode_s > 0 else 0.0
