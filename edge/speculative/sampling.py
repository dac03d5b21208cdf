"""Logits -> probability distributions, and sampling from them. Pure numpy.

Everything is float64: the speculative verifier divides and subtracts these
numbers, and the lossless guarantee is only as good as they are.
"""
from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum
from typing import Optional, Sequence, Tuple, Union

import numpy as np


@dataclass(frozen=True)
class SamplingParams:
    """How the target (or a draft) turns logits into a next token.

    temperature 0 means greedy (argmax); top_k 0 and top_p 1.0 switch those
    filters off; seed makes a generation reproducible (None: fresh entropy).
    Each party that samples draws its own stream from the seed: see role_rng.

    The logit adjustments (OpenAI's presence / frequency penalties and
    logit_bias, vLLM's repetition_penalty) change the target's own
    distribution before all of that: adjust_logits. They are the target's
    alone -- the wire (to_wire) does not carry them, so a draft proposes
    unadjusted and the verification against the adjusted target keeps the
    output exact (only the acceptance pays).
    """
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: Optional[int] = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: Tuple[Tuple[int, float], ...] = ()     # (token id, bias) pairs

    def __post_init__(self):
        t = self.temperature
        if not isinstance(t, (int, float)) or not np.isfinite(t) or t < 0:
            raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {t!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, (int, np.integer)) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0 = off), got {self.top_k!r}")
        p = self.top_p
        if not isinstance(p, (int, float)) or not (0.0 < p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1] (1.0 = off), got {p!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, (int, np.integer))):
            raise ValueError(f"seed must be an integer or None, got {self.seed!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not -2.0 <= v <= 2.0:
                raise ValueError(f"{name} must be a number in [-2, 2] (0 = off), got {v!r}")
        r = self.repetition_penalty
        if isinstance(r, bool) or not isinstance(r, (int, float)) or not 0.0 < r <= 10.0:
            raise ValueError(f"repetition_penalty must be in (0, 10] (1 = off), got {r!r}")
        if not all(isinstance(t, int) and t >= 0 and np.isfinite(b) for t, b in self.logit_bias):
            raise ValueError("logit_bias must be (token id >= 0, finite bias) pairs")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def adjusts_logits(self) -> bool:
        """Whether adjust_logits changes anything (else the target's logits are used as they are)."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
                    or self.logit_bias)

    @classmethod
    def from_wire(cls, d: dict) -> "SamplingParams":
        """From a message's sampling dict (edge.wire.protocol.sampling makes them)."""
        return cls(d["temperature"], d["top_k"], d["top_p"], d.get("seed"))

    def to_wire(self) -> dict:
        """The sampling dict a message carries (plain types: msgpack takes no numpy scalars)."""
        return {"temperature": float(self.temperature), "top_k": int(self.top_k),
                "top_p": float(self.top_p), "seed": None if self.seed is None else int(self.seed)}


GREEDY = SamplingParams()


class Role(IntEnum):
    """The spawn keys of the random streams derived from one request seed.

    TARGET   1001  the target: speculative acceptance uniforms, residual and
                   bonus draws, plain sampling (edge/speculative/generate.py)
    DRAFT    1002  a draft's proposals: a local ModelDrafter with no extra key;
                   the draft service adds (session digest, stream number)
    PREFILL  1003  SUN's prefill worker: the first answer token
    DECODER  1004  SUN's shared decoder: every later token

    Keys start at 1001 so that they never equal the children 0, 1, 2, ...
    that SeedSequence(seed).spawn() would hand anyone else using the seed.
    """
    TARGET = 1001
    DRAFT = 1002
    PREFILL = 1003
    DECODER = 1004


def role_rng(seed: Optional[int], role: Role, *extra: int) -> np.random.Generator:
    """The random stream of one party of a generation seeded with `seed`.

    Two parties that draw uniforms from the same stream correlate (a draft's
    proposal and the target's acceptance test would use the same number, and
    speculative sampling is then no longer lossless), so each party derives its
    own: SeedSequence(seed, spawn_key=(role, *extra)). Distinct spawn keys give
    independent streams; `extra` (non-negative ints) separates several streams
    of one role. seed None: fresh OS entropy (independent of everything).

    What a seed promises: each role gets the same stream for the same seed, so
    plain decoding, local speculation (ModelDrafter) and SUN's prefill + decoder
    reproduce their text exactly. Through the StarSD star the draft service's
    stream is per session (edge/star/draft_service.py): the text then has exactly the
    target's distribution, but is not a fixed string.
    """
    if seed is None:
        return np.random.default_rng()
    key = (int(role),) + tuple(int(e) for e in extra)
    return np.random.default_rng(np.random.SeedSequence(int(seed), spawn_key=key))


def _as_logits(logits) -> np.ndarray:
    x = np.asarray(logits, dtype=np.float64)
    if x.ndim not in (1, 2) or x.shape[-1] == 0:
        raise ValueError(f"logits must be [vocab] or [rows, vocab] with vocab > 0, got shape {x.shape}")
    # One reduction catches NaN, +inf and all -inf rows (max is then not finite).
    if not np.isfinite(x.max(axis=-1)).all():
        if np.isnan(x).any() or np.isposinf(x).any():
            raise ValueError("logits contain NaN or +inf; the model produced invalid numbers")
        raise ValueError("a logits row is -inf everywhere; no token is possible")
    return x


def adjust_logits(rows, params: SamplingParams, context: Sequence[int], n_prompt: int,
                  drafts: Sequence[int] = ()) -> np.ndarray:
    """The target's logits [rows, V] after params' penalties and logit_bias, as float64.

    Row j is the distribution after `context` (prompt + committed tokens) and
    drafts[:j] -- a verify call's rows -- so each row counts exactly the
    tokens before its position, as plain decoding would: that is what keeps
    speculation lossless. Presence and frequency count the generated tokens
    (context[n_prompt:], as OpenAI and vLLM do); the repetition penalty every
    token seen, the prompt included (as vLLM). Rows are returned unchanged
    (not copied) when params adjust nothing.
    """
    if not params.adjusts_logits:
        return rows
    out = np.array(rows, dtype=np.float64)           # a copy: the engine's buffer stays as it was
    vocab = out.shape[-1]
    bias_ids = np.array([t for t, _ in params.logit_bias if t < vocab], dtype=np.int64)
    bias = np.array([b for t, b in params.logit_bias if t < vocab], dtype=np.float64)
    counts = np.bincount(np.asarray(context[n_prompt:], dtype=np.int64), minlength=vocab)[:vocab]
    seen = np.zeros(vocab, dtype=bool)
    ctx = np.asarray(context, dtype=np.int64)
    seen[ctx[ctx < vocab]] = True                    # a prompt id past the logits has no logit to penalise
    for j in range(out.shape[0]):
        if j:                                            # the draft before this row is in its context
            counts[drafts[j - 1]] += 1
            seen[drafts[j - 1]] = True
        row = out[j]
        row[bias_ids] += bias
        if params.repetition_penalty != 1.0:
            hit = row[seen]
            row[seen] = np.where(hit > 0, hit / params.repetition_penalty, hit * params.repetition_penalty)
        row -= counts * params.frequency_penalty + (counts > 0) * params.presence_penalty
    return out


def top_logprobs(row, token: int, n: int) -> Tuple[float, list]:
    """log-softmax of one logits row: the token's logprob and the n most likely (id, logprob) pairs."""
    x = np.asarray(row, dtype=np.float64)
    m = x.max()
    lp = x - (m + np.log(np.exp(x - m).sum()))
    if n <= 0:
        return float(lp[token]), []
    top = np.argpartition(-lp, min(n, lp.size) - 1)[:n]
    top = top[np.lexsort((top, -lp[top]))]               # most likely first, ties by id
    top = top[np.isfinite(lp[top])]                      # a token a grammar forbids is no alternative
    return float(lp[token]), [(int(t), float(lp[t])) for t in top]


def _filter_rows(z: np.ndarray, params: SamplingParams) -> np.ndarray:
    """Scaled logits [rows, V] -> probabilities after top-k then top-p."""
    rows, v = z.shape
    r = np.arange(rows)[:, None]
    if 0 < params.top_k < v:
        # Stable sort so ties are broken by token id, identically every time.
        top = np.argsort(-z, axis=-1, kind="stable")[:, : params.top_k]
        kept = np.full_like(z, -np.inf)
        kept[r, top] = z[r, top]
        z = kept
    probs = np.exp(z - z.max(axis=-1, keepdims=True))
    probs /= probs.sum(axis=-1, keepdims=True)
    if params.top_p < 1.0:
        order = np.argsort(-probs, axis=-1, kind="stable")
        sorted_p = probs[r, order]
        # Keep the smallest prefix whose mass reaches top_p (at least one token):
        # a token stays if the mass strictly before it is still below top_p.
        drop = (np.cumsum(sorted_p, axis=-1) - sorted_p) >= params.top_p
        probs[np.nonzero(drop)[0], order[drop]] = 0.0
        probs /= probs.sum(axis=-1, keepdims=True)
    return probs


def to_probs(logits, params: SamplingParams) -> np.ndarray:
    """Logits ([V] or [rows, V]) -> float64 probabilities of the same shape.

    Order as in Hugging Face: temperature, then top-k, then top-p. Greedy
    gives a one-hot row at argmax (first index on ties, like np.argmax).
    """
    x = _as_logits(logits)
    rows = x.reshape(-1, x.shape[-1])
    if params.greedy:
        out = np.zeros_like(rows)
        out[np.arange(rows.shape[0]), rows.argmax(axis=-1)] = 1.0
    else:
        with np.errstate(over="ignore"):
            z = rows / params.temperature
        over = ~np.isfinite(z.max(axis=-1))
        if over.any():
            # A temperature so small that logits overflow: the limit is the
            # uniform law over the row's maxima (greedy up to ties).
            top = rows[over] == rows[over].max(axis=-1, keepdims=True)
            z[over] = np.where(top, 0.0, -np.inf)
        out = _filter_rows(z, params)
    return out.reshape(x.shape)


@dataclass(frozen=True)
class SparseDist:
    """A distribution over a few token ids, given exactly: what a draft sampled
    from after top-k truncation, and what it sends to the target (docs/architecture.md)."""
    indices: np.ndarray   # int64, unique, >= 0
    probs: np.ndarray     # float64, >= 0, summing to 1

    def __post_init__(self):
        idx = np.asarray(self.indices)
        p = np.asarray(self.probs, dtype=np.float64)
        if idx.ndim != 1 or p.ndim != 1 or idx.shape != p.shape or idx.size == 0:
            raise ValueError(f"SparseDist needs two 1-D arrays of the same non-zero length, "
                             f"got indices {idx.shape} and probs {p.shape}")
        if not np.issubdtype(idx.dtype, np.integer):
            raise ValueError(f"SparseDist indices must be integers, got dtype {idx.dtype}")
        if (idx < 0).any() or np.unique(idx).size != idx.size:
            raise ValueError("SparseDist indices must be unique token ids >= 0")
        if not np.isfinite(p).all() or (p < 0).any() or abs(p.sum() - 1.0) > 1e-6:
            raise ValueError(f"SparseDist probs must be finite, >= 0 and sum to 1 (sum is {p.sum()!r})")
        object.__setattr__(self, "indices", idx.astype(np.int64))
        object.__setattr__(self, "probs", p)

    def __len__(self) -> int:
        return int(self.indices.size)

    def dense(self, vocab: int) -> np.ndarray:
        if int(self.indices.max()) >= vocab:
            raise ValueError(f"SparseDist has token id {int(self.indices.max())} outside a vocabulary of {vocab}")
        out = np.zeros(vocab, dtype=np.float64)
        out[self.indices] = self.probs
        return out

    def prob_of(self, token: int) -> float:
        hit = np.flatnonzero(self.indices == token)
        return float(self.probs[hit[0]]) if hit.size else 0.0

    @classmethod
    def one_hot(cls, token: int) -> "SparseDist":
        return cls._trusted(np.array([int(token)], dtype=np.int64), np.array([1.0]))

    @classmethod
    def _trusted(cls, indices: np.ndarray, probs: np.ndarray) -> "SparseDist":
        """Skip validation for distributions built here (hot path)."""
        obj = object.__new__(cls)
        object.__setattr__(obj, "indices", indices)
        object.__setattr__(obj, "probs", probs)
        return obj


Dist = Union[np.ndarray, SparseDist]


def _sample_dense(probs: np.ndarray, rng: np.random.Generator) -> int:
    cdf = np.cumsum(probs)
    total = cdf[-1]
    if not np.isfinite(total) or total <= 0:
        raise ValueError("cannot sample: the distribution has no positive mass")
    i = int(np.searchsorted(cdf, rng.random() * total, side="right"))
    # u*total may round up to total: fall back to the last token with mass.
    if i >= probs.size:
        i = int(np.flatnonzero(probs > 0)[-1])
    return i


def draw(probs: Dist, rng: np.random.Generator) -> int:
    """sample() without input checks, for distributions built by this package
    (to_probs, truncate_top_k, verification residuals): the hot path."""
    if isinstance(probs, SparseDist):
        return int(probs.indices[_sample_dense(probs.probs, rng)])
    return _sample_dense(probs, rng)


def sample(probs: Dist, rng: np.random.Generator) -> int:
    """Draw one token id from a dense [V] distribution or a SparseDist."""
    if isinstance(probs, SparseDist):
        return int(probs.indices[_sample_dense(probs.probs, rng)])
    p = np.asarray(probs, dtype=np.float64)
    if p.ndim != 1:
        raise ValueError(f"sample() needs one distribution [vocab], got shape {p.shape}")
    if (p < 0).any() or not np.isfinite(p).all():
        raise ValueError("sample() needs finite, non-negative probabilities")
    return _sample_dense(p, rng)


def truncate_top_k(probs, k: int) -> SparseDist:
    """The k most likely tokens of a dense distribution, renormalised.

    Zero-probability tokens are left out (so fewer than k may come back).
    The draft samples from exactly this SparseDist and sends exactly it.
    """
    p = np.asarray(probs, dtype=np.float64)
    if p.ndim != 1:
        raise ValueError(f"truncate_top_k needs one distribution [vocab], got shape {p.shape}")
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 1:
        raise ValueError(f"top-k for the draft must be an integer >= 1, got {k!r}")
    if (p < 0).any() or not np.isfinite(p).all() or p.sum() <= 0:
        raise ValueError("truncate_top_k needs finite, non-negative probabilities with positive mass")
    k = min(int(k), p.size)
    if p.size > 4096 and k < p.size:
        # Large vocabularies: partition first, then order only the k survivors.
        top = np.argpartition(-p, k - 1)[:k]
        top = top[np.lexsort((top, -p[top]))]
    else:
        top = np.argsort(-p, kind="stable")[:k]
    # Deterministic order: by probability descending, then token id.
    top = top[p[top] > 0].astype(np.int64)
    vals = p[top]
    return SparseDist._trusted(top, vals / vals.sum())


def pick(logits, params: SamplingParams, rng: Optional[np.random.Generator] = None,
         top_k: int = 0) -> Tuple[int, Optional[Dist]]:
    """The next token from one logits row, and exactly what it was drawn from.

    Greedy: argmax, and no distribution (None). Otherwise a draw from the
    filtered distribution -- its top_k most likely tokens when top_k > 0, which
    a draft then sends as q -- with `rng`, the caller's own stream (role_rng):
    a generator of the bare seed would replay another party's uniforms.
    """
    if params.greedy:
        return int(np.argmax(logits)), None
    if rng is None:
        raise ValueError("sampling needs the caller's random stream (role_rng)")
    q = to_probs(logits, params)
    if top_k:
        q = truncate_top_k(q, top_k)
    return draw(q, rng), q
