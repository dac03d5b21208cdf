"""Emulated remote target devices for the StarSD benchmark.

An emulated target runs the REAL target code (edge.star.target.StarTarget:
join, DraftRequest/DraftResponse over MQTT, deadlines, greedy verification by
edge.speculative.generate) on a fake engine whose cost and acceptance come from a device
profile and a measured acceptance rate:

* `EmulatedEngine.forward(seq, [pending] + drafts)` sleeps what one call over
  k tokens costs on the device (device profile: single step x verify cost(k))
  and returns logits whose argmax accepts each draft with probability alpha,
  independently, up to the first rejection (the i.i.d. assumption behind
  E = (1 - a^(g+1)) / (1 - a)). Only the costs and alpha are emulated; the
  protocol, broker, draft service and verification code are real. A round's
  count of accepted drafts is drawn by inverse CDF from a low-discrepancy
  sequence of uniforms, so every point of a sweep sees the same mean
  acceptance: with plain random draws over the ~45 rounds of a 30 s point, the
  N=1 point accepted 2.95 tokens a round against the expected 2.67 and every
  per-target ratio to it read ~10% low.
* `DelayLink` adds the device's network delay: half the round trip on the way
  out, half on the way in, in order.
* `MeasuringHubClient` records, per draft answer, the round trip seen by the
  target and the draft's own `compute_us`: round trip - compute - emulated
  network = protocol overhead (encode, HMAC, broker, decode, wake-up).
* `EmulatedDrafter` is a draft model on the device itself (the co-located
  baseline): it sleeps gamma draft steps of the device and proposes tokens.
"""
from __future__ import annotations

import heapq
import itertools
import threading
import time
from dataclasses import dataclass, field, replace
from typing import Callable, Dict, List, Optional, Sequence

import numpy as np

from edge.speculative.drafter import Drafter
from edge.engines.base import Engine, EngineError
from edge.wire.link import Link
from edge.wire.protocol import DraftResponse, Error
from edge.star.hub_client import HubClient, Session

# Weights of the real pair (docs/models.md): bytes of the Q4_K_M files, parameter counts.
TARGET_BYTES, TARGET_PARAMS = 1_117_320_768, 1.54e9      # Qwen2.5-Coder-1.5B-Instruct Q4_K_M
DRAFT_BYTES, DRAFT_PARAMS = 491_400_064, 0.494e9         # Qwen2.5-Coder-0.5B-Instruct Q4_K_M


@dataclass
class DeviceTiming:
    """What a call costs on the emulated device (ms), from a device profile."""
    profile: str
    target_step_ms: float          # one target decode step (k = 1)
    draft_step_ms: float           # one step of the draft model ON the device (co-located baseline)
    net_rtt_ms: float              # device <-> hub network round trip
    time_scale: float = 1.0        # every device time multiplied by this
    verify_override: Dict[int, float] = field(default_factory=dict)
    source: str = ""
    step_override_ms: Optional[float] = None   # a target step given (measured), not the roofline's

    @classmethod
    def from_profile(cls, profile: str, net_rtt_ms: float = 2.0, time_scale: float = 1.0,
                     verify_override: Optional[Dict[int, float]] = None,
                     target_step_ms: Optional[float] = None) -> "DeviceTiming":
        """`target_step_ms`: the target's step as given (e.g. a target measured on this machine);
        the device's own draft step and the network keep the profile's figures."""
        p = _profile(profile, verify_override)
        step = target_step_ms or time_scale * p.call_ms(TARGET_BYTES, TARGET_PARAMS, 1)
        return cls(profile, step, time_scale * p.call_ms(DRAFT_BYTES, DRAFT_PARAMS, 1), time_scale * net_rtt_ms,
                   time_scale, dict(verify_override or {}), p.source, target_step_ms)

    def verify_cost(self, k: int) -> float:
        """Cost of one call over k tokens, in single-step units (profile table or roofline)."""
        return _profile(self.profile, self.verify_override).verify_cost(k, TARGET_BYTES, TARGET_PARAMS)

    def call_ms(self, k: int) -> float:
        return self.target_step_ms * self.verify_cost(k)

    def to_dict(self) -> dict:
        return {"profile": self.profile, "net_rtt_ms": self.net_rtt_ms / self.time_scale,
                "time_scale": self.time_scale, "verify_override": {str(k): v for k, v in self.verify_override.items()},
                "target_step_ms": self.step_override_ms}

    @classmethod
    def from_dict(cls, d: dict) -> "DeviceTiming":
        return cls.from_profile(d["profile"], d["net_rtt_ms"], d["time_scale"],
                                {int(k): float(v) for k, v in d.get("verify_override", {}).items()},
                                d.get("target_step_ms"))


_PROFILES: dict = {}


def _profile(name: str, override: Optional[Dict[int, float]]):
    from devices.profile import load_profile
    key = (name, tuple(sorted((override or {}).items())))
    if key not in _PROFILES:
        p = load_profile(name)
        if override:
            p = replace(p, verify_cost_table={**p.verify_cost_table, **override})
        _PROFILES[key] = p
    return _PROFILES[key]


GOLDEN = (5 ** 0.5 - 1) / 2      # Weyl sequence step: frac(u0 + i * GOLDEN) fills [0, 1) evenly


def accepted_drafts(u: float, alpha: float, most: int) -> int:
    """Drafts accepted in a row, each with probability alpha, from one uniform u: the inverse
    CDF of P(n >= j) = alpha^j, capped at `most` (the drafts sent)."""
    if alpha >= 1.0 or u <= 0.0:
        return most
    if alpha <= 0.0:
        return 0
    return min(most, int(np.floor(np.log(u) / np.log(alpha))))


def _sleep_until(t: float) -> None:
    left = t - time.monotonic()
    if left > 0:
        time.sleep(left)


class _Counters:
    """Rounds and acceptance as the target's verification sees them."""

    def __init__(self) -> None:
        self.calls = 0          # target calls after prefill (one per round, plain steps included)
        self.drafted = 0
        self.accepted = 0
        self.plain = 0          # rounds without drafts (draft late, or decoding alone)


class EmulatedEngine(Engine, _Counters):
    """A target engine that costs what the device costs and accepts with probability alpha."""

    name = "emulated"

    def __init__(self, timing: DeviceTiming, alpha: float, vocab_size: int, seed: int = 0,
                 max_len: int = 1 << 20, fingerprint: str = "emulated-target"):
        _Counters.__init__(self)
        if not 0.0 <= alpha <= 1.0:
            raise ValueError(f"alpha must be in [0, 1], got {alpha}")
        self.timing, self.alpha = timing, alpha
        self.vocab_size, self.max_len, self.fingerprint = vocab_size, max_len, fingerprint
        self.rng = np.random.default_rng(seed)
        self._u = float(self.rng.random())         # the acceptance sequence's start, per target
        self._len: Dict[int, int] = {}
        self._ids = itertools.count(1)

    def new_sequence(self) -> int:
        s = next(self._ids)
        self._len[s] = 0
        return s

    def free(self, seq: int) -> None:
        self._len.pop(seq, None)

    def tokens(self, seq: int) -> list:
        raise EngineError("the emulated target keeps lengths, not tokens")

    @property
    def active_sequences(self) -> int:
        return len(self._len)

    def length(self, seq: int) -> int:
        if seq not in self._len:
            raise EngineError(f"unknown sequence {seq}")
        return self._len[seq]

    def truncate(self, seq: int, n: int) -> None:
        if not 0 <= n <= self.length(seq):
            raise EngineError(f"cannot truncate to {n}")
        self._len[seq] = n

    def _other(self, avoid: int) -> int:
        t = int(self.rng.integers(0, self.vocab_size))
        return t if t != avoid else (t + 1) % self.vocab_size

    def forward(self, seq: int, tokens: Sequence[int]) -> np.ndarray:
        t0 = time.monotonic()
        k = len(tokens)
        fresh = self.length(seq) == 0
        self.check_room(seq, k)
        rows = np.zeros((k, self.vocab_size), dtype=np.float32)   # calloc: untouched rows cost nothing
        if not fresh and k:                                        # a round (a prefill is not one)
            n = 0
            if k > 1:
                self._u = (self._u + GOLDEN) % 1.0
                n = accepted_drafts(self._u, self.alpha, k - 1)
            for j in range(n):
                rows[j, int(tokens[j + 1])] = 1.0                  # argmax = the draft: accepted
            if n < k - 1:
                rows[n, self._other(int(tokens[n + 1]))] = 1.0     # the correction token
            else:
                rows[k - 1, self._other(-1)] = 1.0                 # the bonus token
            self.calls += 1
            self.drafted += k - 1
            self.accepted += n
            self.plain += k == 1
        self._len[seq] += k
        _sleep_until(t0 + self.timing.call_ms(k) / 1e3)
        return rows

    def step(self, seqs: Sequence[int], tokens: Sequence[int]) -> np.ndarray:
        return np.concatenate([self.forward(s, [t]) for s, t in zip(seqs, tokens)])


class EmulatedDrafter(Drafter):
    """A draft model on the device (co-located pair): gamma device draft steps per round."""

    def __init__(self, timing: DeviceTiming, vocab_size: int):
        self.timing, self.vocab_size, self.name = timing, vocab_size, "emulated-local-draft"

    def draft(self, context, gamma: int, rng):
        t0 = time.monotonic()
        toks = [(int(context[-1]) + 7 * (j + 1)) % self.vocab_size for j in range(gamma)]
        _sleep_until(t0 + gamma * self.timing.draft_step_ms / 1e3)
        return toks, None


class _Delayer:
    """One thread running callbacks at their due times, in order."""

    def __init__(self) -> None:
        self._heap: list = []
        self._cv = threading.Condition()
        self._n = itertools.count()
        threading.Thread(target=self._run, name="net-delay", daemon=True).start()

    def later(self, delay_s: float, fn: Callable, *args) -> None:
        with self._cv:
            heapq.heappush(self._heap, (time.monotonic() + delay_s, next(self._n), fn, args))
            self._cv.notify()

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._heap or self._heap[0][0] > time.monotonic():
                    self._cv.wait(None if not self._heap else self._heap[0][0] - time.monotonic())
                _, _, fn, args = heapq.heappop(self._heap)
            try:
                fn(*args)
            except Exception:  # a callback's failure must not stop the network
                pass


class DelayLink(Link):
    """Wraps a Link: every message out and in is delayed by half the round trip."""

    def __init__(self, inner: Link, rtt_ms: float, delayer: Optional[_Delayer] = None):
        super().__init__(inner.client_id)
        self.inner, self.half = inner, rtt_ms / 2e3
        self.url = getattr(inner, "url", "?")
        self.stats = inner.stats
        self._delayer = delayer or _Delayer()

    def connect(self, timeout: Optional[float] = 10.0) -> "DelayLink":
        self.inner.connect(timeout)
        return self

    def publish(self, topic: str, payload: bytes, kind: str = "control") -> bool:
        if self.half <= 0:
            return self.inner.publish(topic, payload, kind)
        self._delayer.later(self.half, self.inner.publish, topic, payload, kind)
        return self.inner.is_connected()

    def subscribe(self, pattern: str, callback) -> bool:
        if self.half <= 0:
            return self.inner.subscribe(pattern, callback)
        return self.inner.subscribe(pattern, lambda t, p: self._delayer.later(self.half, callback, t, p))

    def unsubscribe(self, pattern: str) -> None:
        self.inner.unsubscribe(pattern)

    def on_connection(self, callback) -> None:
        self.inner.on_connection(callback)

    def set_will(self, topic: str, payload: bytes, retain: bool = True) -> None:
        self.inner.set_will(topic, payload, retain)

    def is_connected(self) -> bool:
        return self.inner.is_connected()

    def close(self) -> None:
        self.inner.close()


class _TimedSession(Session):
    def request(self, seq: int, keep: int, append, *rest, **options) -> bool:
        # the rest (γ, sampling, background, p_min, ...) goes on as given: only the send time is ours
        self.hub.sent[(self.sid, seq)] = (time.monotonic(), len(append))
        return super().request(seq, keep, append, *rest, **options)


class MeasuringHubClient(HubClient):
    """A HubClient that records (receive time, round trip, draft compute, fed) per answer."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.sent: Dict[tuple, tuple] = {}
        self.answers: List[tuple] = []
        self.first_answer = threading.Event()

    session_type = _TimedSession

    def _on_down(self, topic: str, payload: bytes) -> None:
        msg = self.keys.open(topic, payload, self.vocab_size)
        if msg is None:
            return
        now = time.monotonic()
        if isinstance(msg, DraftResponse):
            sent = self.sent.pop((msg.sid, msg.seq), None)
            if sent is not None:
                self.answers.append((now, now - sent[0], msg.compute_us / 1e6, sent[1]))
            self.first_answer.set()
        s = self.sessions.get(msg.sid)
        if s is not None and isinstance(msg, (DraftResponse, Error)):
            s._deliver(msg)
