"""Speculative decoding math: verification and the cost model. Pure, no I/O.

Verification (Leviathan et al. 2023; Chen et al. 2023) keeps the output
distribution exactly the target's, whatever the draft proposed; the draft
only changes how many tokens one target call yields. The cost model says
when that is worth it (docs/architecture.md, "Speculative decoding").
"""
from __future__ import annotations

import math
from collections import deque
from typing import Callable, Optional, Sequence, Tuple

import numpy as np

from edge.speculative.sampling import Dist, SparseDist, draw


def _check_rows(draft_tokens: Sequence[int], rows: np.ndarray, what: str) -> int:
    gamma = len(draft_tokens)
    if rows.ndim != 2 or rows.shape[0] != gamma + 1:
        raise ValueError(f"{what} must be [gamma+1, vocab] = [{gamma + 1}, V] for {gamma} drafted "
                         f"tokens, got shape {rows.shape}")
    vocab = rows.shape[1]
    for t in draft_tokens:
        if not 0 <= int(t) < vocab:
            raise ValueError(f"drafted token id {t} is outside the target vocabulary of {vocab}")
    return vocab


def verify_greedy(draft_tokens: Sequence[int], target_logits) -> Tuple[int, int]:
    """Greedy verification -> (n_accepted, next_token).

    Accept the longest prefix where each draft equals the target's argmax;
    next_token is the argmax at the first mismatch, or the bonus position.
    """
    logits = np.asarray(target_logits)
    _check_rows(draft_tokens, logits, "target_logits")
    best = logits.argmax(axis=-1)
    for i, x in enumerate(draft_tokens):
        if int(best[i]) != int(x):
            return i, int(best[i])
    return len(draft_tokens), int(best[len(draft_tokens)])


def _q_of(q: Dist, token: int) -> float:
    if isinstance(q, SparseDist):
        return q.prob_of(token)
    return float(q[token])


def _residual(p: np.ndarray, q: Dist) -> np.ndarray:
    """max(0, p - q) as a dense row (not normalised)."""
    r = p.copy()
    if isinstance(q, SparseDist):
        r[q.indices] -= q.probs
    else:
        r -= q
    np.maximum(r, 0.0, out=r)
    return r


def verify_stochastic(draft_tokens: Sequence[int], q_list: Sequence[Dist], p,
                      rng: np.random.Generator) -> Tuple[int, int]:
    """Lossless stochastic verification -> (n_accepted, next_token).

    draft_tokens x_1..x_gamma were sampled from q_list[i] (dense [V] rows or
    SparseDist, exactly what the draft sampled from); p is [gamma+1, V] target
    probabilities. Accept x_i with probability min(1, p_i(x_i)/q_i(x_i)); at the
    first rejection sample from norm(max(0, p_i - q_i)); when all are accepted,
    sample a bonus token from p_{gamma+1}.
    """
    p = np.asarray(p, dtype=np.float64)
    vocab = _check_rows(draft_tokens, p, "target probabilities p")
    if (p < 0).any() or not np.isfinite(p).all():
        raise ValueError("target probabilities p must be finite and >= 0 (use edge.speculative.sampling.to_probs)")
    if len(q_list) != len(draft_tokens):
        raise ValueError(f"need one draft distribution per drafted token: {len(draft_tokens)} tokens, "
                         f"{len(q_list)} distributions")
    for i, (x, q) in enumerate(zip(draft_tokens, q_list)):
        x = int(x)
        if not isinstance(q, SparseDist):
            q = np.asarray(q, dtype=np.float64)
            if q.shape != (vocab,):
                raise ValueError(f"draft distribution {i} has shape {q.shape}, the target vocabulary is {vocab}")
        elif int(q.indices.max()) >= vocab:
            raise ValueError(f"draft distribution {i} names token {int(q.indices.max())}, "
                             f"outside the target vocabulary of {vocab}")
        qx = _q_of(q, x)
        if not qx > 0:
            # The draft claims it sampled a token it gave no mass: its q is not
            # what it sampled from, and no verifier can stay lossless with it.
            raise ValueError(f"drafted token {x} at position {i} has probability {qx} under the draft's "
                             f"own distribution; the draft must send exactly the q it sampled from")
        px = float(p[i, x])
        if px >= qx or rng.random() * qx < px:
            continue
        r = _residual(p[i], q)
        if r.sum() <= 0:
            # Only reachable through rounding when p and q (almost) coincide;
            # the residual is then meaningless and p itself is the right law.
            return i, draw(p[i], rng)
        return i, draw(r, rng)
    return len(draft_tokens), draw(p[len(draft_tokens)], rng)


# ----------------------------------------------------------------- cost model

def expected_tokens(alpha: float, gamma: int) -> float:
    """Expected tokens per verification with per-token acceptance alpha:
    (1 - alpha^(gamma+1)) / (1 - alpha); gamma + 1 when alpha == 1."""
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"acceptance rate alpha must be in [0, 1], got {alpha!r}")
    if gamma < 0:
        raise ValueError(f"gamma must be >= 0, got {gamma!r}")
    if alpha >= 1.0 - 1e-12:
        return float(gamma + 1)
    return (1.0 - alpha ** (gamma + 1)) / (1.0 - alpha)


def predicted_speedup(alpha: float, gamma: int, c: float,
                      verify_cost: Callable[[int], float]) -> float:
    """Speedup over target-only decoding: E / (gamma * c + v(gamma + 1)).

    c is one draft step in target single-step units; verify_cost(k) is one
    target call over k tokens in the same units (v(1) = 1 by definition, but a
    measured v(1) is used as given). The verify call feeds the pending token
    plus the gamma drafts, hence k = gamma + 1.
    """
    if c < 0:
        raise ValueError(f"draft cost ratio c must be >= 0, got {c!r}")
    cost = gamma * c + float(verify_cost(gamma + 1))
    if not cost > 0:
        raise ValueError(f"the cost of a round must be positive, got {cost!r} for gamma={gamma}")
    return expected_tokens(alpha, gamma) / cost


def choose_gamma(alpha: float, c: float, verify_cost: Callable[[int], float],
                 max_gamma: int, margin: float = 0.0) -> int:
    """The gamma in 0..max_gamma with the best predicted speedup.

    0 means "do not speculate": it is returned unless some gamma >= 1 beats
    target-only decoding by more than `margin` (relative).
    """
    if max_gamma < 0:
        raise ValueError(f"max_gamma must be >= 0, got {max_gamma!r}")
    base = predicted_speedup(alpha, 0, c, verify_cost)
    best, best_s = 0, base * (1.0 + margin)
    for g in range(1, max_gamma + 1):
        s = predicted_speedup(alpha, g, c, verify_cost)
        if s > best_s:
            best, best_s = g, s
    return best


class AcceptanceTracker:
    """Online estimate of the per-token acceptance rate alpha.

    A round that drafted gamma tokens and accepted n observed n successes and,
    if n < gamma, one failure (tokens after a rejection are never tested) —
    the maximum-likelihood view under the geometric model behind
    expected_tokens(). The prior enters as `prior_weight` pseudo-trials that
    decay with the data by `decay` per round (EWMA), so alpha follows the text
    and the prior fades instead of biasing it forever.
    """

    def __init__(self, prior: float = 0.6, prior_weight: float = 2.0, decay: float = 0.9):
        if not 0.0 <= prior <= 1.0:
            raise ValueError(f"prior alpha must be in [0, 1], got {prior!r}")
        if prior_weight <= 0 or not 0.0 < decay <= 1.0:
            raise ValueError("prior_weight must be > 0 and decay in (0, 1]")
        self.prior, self.prior_weight, self.decay = prior, prior_weight, decay
        self.successes = prior * prior_weight
        self.trials = float(prior_weight)
        self.rounds = 0

    def update(self, drafted: int, accepted: int) -> None:
        if not 0 <= accepted <= drafted:
            raise ValueError(f"accepted ({accepted}) must be between 0 and drafted ({drafted})")
        if drafted == 0:
            return
        trials = accepted + (1 if accepted < drafted else 0)
        self.successes = self.decay * self.successes + accepted
        self.trials = self.decay * self.trials + trials
        self.rounds += 1

    @property
    def alpha(self) -> float:
        return self.successes / self.trials


class CostTracker:
    """Measured costs for the adaptive gamma: target call time vs tokens fed
    (k), and draft time per drafted token. Fed with seconds; reads no clock.

    Medians over the last `window` samples per k resist the odd slow call on
    a shared machine. verify_cost(k) interpolates linearly between measured k
    (extrapolating with the last slope, never negative); with one measured k
    it assumes `prior_slope` extra single-steps per extra token.
    """

    def __init__(self, window: int = 16, prior_slope: float = 0.3):
        self.window = window
        self.prior_slope = prior_slope
        self._target: dict[int, deque] = {}
        self._draft: deque = deque(maxlen=window)
        self._points = None      # cached (ks, medians): choose_gamma asks many times a round
        self._draft_median = None

    def add_target(self, k: int, seconds: float) -> None:
        if k < 1 or seconds < 0:
            raise ValueError(f"a target call needs k >= 1 tokens and seconds >= 0, got k={k}, {seconds}")
        self._target.setdefault(int(k), deque(maxlen=self.window)).append(float(seconds))
        self._points = None

    def add_draft(self, n_drafted: int, seconds: float) -> None:
        if n_drafted > 0:
            self._draft.append(float(seconds) / n_drafted)
            self._draft_median = None

    def has_target(self, k: int) -> bool:
        return bool(self._target.get(k))

    def samples(self, k: int) -> int:
        """How many target calls over k tokens are in the window."""
        return len(self._target.get(k, ()))

    @property
    def has_draft(self) -> bool:
        return bool(self._draft)

    def target_seconds(self, k: int) -> Optional[float]:
        """Estimated seconds of one target call over k tokens (None: nothing measured)."""
        if self._points is None:
            pts = sorted((kk, float(np.median(v))) for kk, v in self._target.items() if v)
            self._points = ([p[0] for p in pts], [p[1] for p in pts])
        ks, ts = self._points
        if not ks:
            return None
        if len(ks) == 1:
            return ts[0] * (1.0 + self.prior_slope * (k - ks[0]) / (1.0 + self.prior_slope * (ks[0] - 1)))
        if k <= ks[0]:
            slope = max(0.0, (ts[1] - ts[0]) / (ks[1] - ks[0]))
            return max(ts[0] - slope * (ks[0] - k), 1e-12)
        if k >= ks[-1]:
            slope = max(0.0, (ts[-1] - ts[-2]) / (ks[-1] - ks[-2]))
            return ts[-1] + slope * (k - ks[-1])
        return float(np.interp(k, ks, ts))

    def verify_cost(self, k: int) -> float:
        """Target call over k tokens, in single-step units (v(1) = 1)."""
        one = self.target_seconds(1)
        if one is None:
            return 1.0 + self.prior_slope * (k - 1)
        return self.target_seconds(k) / one

    @property
    def c(self) -> float:
        """Draft seconds per drafted token / target single-step seconds."""
        one = self.target_seconds(1)
        if one is None or not self._draft:
            return math.nan
        if self._draft_median is None:
            self._draft_median = float(np.median(self._draft))
        return self._draft_median / one
