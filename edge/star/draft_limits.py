"""What one draft service takes on (sessions, KV memory, γ, draft-ahead), and the refusal past it."""
from __future__ import annotations

from dataclasses import dataclass

from edge.wire.protocol import E_OVERLOADED


class DraftRefused(RuntimeError):
    """The service cannot take a session (limits); `reason` says which and what to do."""

    def __init__(self, reason: str, code: str = E_OVERLOADED):
        super().__init__(reason)
        self.reason, self.code = reason, code


@dataclass
class DraftLimits:
    max_sessions: int = 64
    max_kv_mb: float = 1024.0        # KV memory the engine holds for all sessions, as allocated (MB = 1e6 B)
    max_gamma: int = 16
    evict_after_s: float = 60.0      # a session silent this long is evicted
    q_top_k: int = 32                # entries of q per drafted token when sampling
    ahead: bool = True               # draft-ahead in idle time
    coalesce: bool = False           # hold a batch for sessions due back (edge/star/batch_hold.py)
    # iteration-level batching: one engine step per loop turn, a request arriving meanwhile joins
    # the batch at the next step instead of waiting for the whole batch (then nothing is held)
    join: bool = False
    ahead_sessions: int = 8          # most recently served sessions considered
    ahead_recent_s: float = 5.0      # ... served within this many seconds
    # a chain stops at a draft the model gives less than this (its top probability there); 0 here
    # drafts every γ asked for, the command line's --draft-p-min defaults to 0.75 (as llama-server)
    p_min: float = 0.0

    def __post_init__(self):
        if not 0.0 <= self.p_min < 1.0:
            raise ValueError(f"draft p_min must be in [0, 1) (0: always draft γ tokens), got {self.p_min!r}")

