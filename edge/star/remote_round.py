"""What a RemoteDrafter (edge/star/remote_drafter.py) keeps about its rounds: how long to wait for
an answer (`Deadline`), the request on its way (`Outstanding`), what the draft holds of our
context (`DraftHeld`), backoffs and its counters (`DrafterStats`)."""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field, fields
from typing import NamedTuple, Optional, Sequence

from edge.speculative.common_prefix import common_prefix

RTT_SAMPLES = 4096      # round-trip samples kept


class Deadline:
    """How long to wait for a draft answer: srtt + 4·rttvar (RFC 6298 style), clamped.

    A request for γ drafts takes the draft γ times its per-token time, so with adaptive γ
    (requests of different sizes) the samples are normalised to one draft and `for_gamma`
    adds the per-token time back: a deep request after shallow ones is not given up on early."""

    def __init__(self, initial: float = 0.5, lo: float = 0.002, hi: float = 1.0):
        self.lo, self.hi = lo, hi
        self.srtt: Optional[float] = None
        self.rttvar = 0.0
        self.value = initial

    def sample(self, rtt: float, gamma: int = 1, per_token_s: float = 0.0) -> None:
        rtt = max(0.0, rtt - max(0, gamma - 1) * per_token_s)
        if self.srtt is None:
            self.srtt, self.rttvar = rtt, rtt / 2
        else:
            self.rttvar = 0.75 * self.rttvar + 0.25 * abs(self.srtt - rtt)
            self.srtt = 0.875 * self.srtt + 0.125 * rtt
        self.value = min(self.hi, max(self.lo, self.srtt + 4 * self.rttvar))

    def for_gamma(self, gamma: int, per_token_s: float = 0.0) -> float:
        return min(self.hi, self.value + max(0, gamma - 1) * 1.25 * per_token_s)

    def timed_out(self) -> None:
        self.value = min(self.hi, self.value * 1.5)


@dataclass
class Outstanding:
    """A request sent and not yet answered (one at a time)."""
    seq: int
    keep: int
    length: int            # context length the request named
    sent: float
    deadline: float        # math.inf: primed, its clock starts at the first round
    give_up: float
    fed: int               # len(append): long ones (a prompt) cost the draft a prefill
    gamma: int = 1         # drafts asked for
    background: bool = False   # a probe observe() sent: nobody waits for it
    ahead: int = 0             # its first drafts the target picks itself before waiting (prime)

    @property
    def primed(self) -> bool:
        return self.deadline == float("inf")


def _samples() -> deque:
    return deque(maxlen=RTT_SAMPLES)


@dataclass
class DrafterStats:
    """A RemoteDrafter's counters over one generation (read by tests, demos and benchmarks)."""
    rounds: int = 0                 # draft() calls
    answered: int = 0               # answers (with drafts or none; errors apart), probes' included
    late_used: int = 0              # answers used after the target decoded past their context
    timeouts: int = 0               # requests given up on
    alone: int = 0                  # rounds with no answer to use: the target decoded alone
    probes: int = 0                 # background probes sent (observe)
    probe_answers: int = 0          # ... and answered
    errors: int = 0                 # error answers, and answers with an unusable q
    overloaded: int = 0             # error answers saying the draft service is overloaded
    joins: int = 0                  # blocking joins (connect)
    rejoins: int = 0                # background joins after the session was lost
    refused: int = 0                # background joins the hub refused
    answered_since_join: int = 0
    rtt_s: deque = field(default_factory=_samples)        # round trips of short feeds
    overhead_s: deque = field(default_factory=_samples)   # ... minus the draft's own compute

    def as_dict(self) -> dict:
        """The counters by name, the samples as lists (JSON-ready)."""
        return {f.name: list(v) if isinstance(v := getattr(self, f.name), deque) else v for f in fields(self)}


class Backoff:
    """A wait that doubles after each failure, from `lo` up to `hi`, and starts over on success."""

    def __init__(self, lo: float, hi: float):
        self.lo, self.hi = lo, hi
        self.next_s = lo

    def failed(self) -> float:
        """The wait to take now (the next one doubles)."""
        wait, self.next_s = self.next_s, min(self.hi, 2 * self.next_s)
        return wait

    def reset(self) -> None:
        self.next_s = self.lo


class DraftHeld(NamedTuple):
    """What the draft holds of our context: context[:keep], or (after an answer to a request that
    named context length `length` with `drafts`) context[:length] + drafts[:-1]."""
    keep: int = 0
    length: int = 0
    drafts: tuple = ()

    def keep_for(self, context: Sequence[int]) -> int:
        """A lower bound on the tokens of `context` the draft holds."""
        if self.length:
            return self.length + common_prefix(self.drafts[:-1], context[self.length:])
        return self.keep
