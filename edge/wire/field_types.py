"""The wire's field types: each checker takes a wire value and returns the Python value or
raises ProtocolError with the field's name. Arrays travel as [dtype, shape, bytes] with an
allow-list of little-endian dtypes; a draft's sparse q as one concatenated triple.
edge/wire/protocol.py declares every message with these.
"""
from __future__ import annotations

import math
import secrets as _secrets
import re
from typing import Any, Callable, Optional

import numpy as np

# limits a field is checked against (a message outside them is refused, never half-processed)
MAX_GAMMA = 32                 # drafted tokens per request
MAX_VOCAB = 1 << 20            # token ids and vocab sizes stay below this
MAX_TOP_K = 4096               # top-k parameter and q entries per position
MAX_TEMPERATURE = 100.0
MAX_SEQ = (1 << 63) - 1
SECRET_BYTES = (16, 64)        # allowed secret lengths
MAX_GRAMMAR_BYTES = 64 * 1024  # a request's grammar text (llguidance's JSON form), UTF-8 bytes
Q_SUM_TOLERANCE = 1e-3         # q must be a distribution: sum within this of 1
ARRAY_DTYPES = ("<i4", "<i8", "<f4", "<f8")
QEntry = tuple[np.ndarray, np.ndarray]      # (token indices, probabilities)


class ProtocolError(ValueError):
    """A message that must be dropped. `code` groups reasons for counters:
    'size', 'format', 'version', 'auth', 'invalid'."""

    def __init__(self, reason: str, code: str = "invalid"):
        super().__init__(reason)
        self.reason = reason
        self.code = code

_ID = re.compile(r"[A-Za-z0-9_.\-]{1,64}\Z")
_FP = re.compile(r"[A-Za-z0-9_.:\-]{1,128}\Z")
_CODE = re.compile(r"[a-z0-9_]{1,32}\Z")


def check_id(value: Any, what: str = "id") -> str:
    """Client, service and session ids: 1-64 chars of [A-Za-z0-9_.-] (no / + # $)."""
    if not isinstance(value, str) or not _ID.match(value):
        raise ProtocolError(f"{what} must be 1-64 characters of A-Z a-z 0-9 _ . -, got {value!r}")
    return value


def one_of(values, maxlen: int = 64, empty: bool = False):
    """A string that is one of `values` (or "" if empty)."""
    return text(re.compile("(?:" + "|".join(map(re.escape, values)) + r")\Z"), maxlen, empty)


def integer(lo: int, hi: int) -> Callable[[str, Any], int]:
    def check(name: str, v: Any) -> int:
        if type(v) is not int or not lo <= v <= hi:
            raise ProtocolError(f"{name} must be an integer in [{lo}, {hi}], got {_short(v)}")
        return v
    return check


def number(lo: float, hi: float) -> Callable[[str, Any], float]:
    def check(name: str, v: Any) -> float:
        if type(v) not in (int, float) or not math.isfinite(v) or not lo <= v <= hi:
            raise ProtocolError(f"{name} must be a finite number in [{lo}, {hi}], got {_short(v)}")
        return float(v)
    return check


def optional(check: Callable[[str, Any], Any]) -> Callable[[str, Any], Any]:
    """`check`, or None: a reading this sender does not have (no power sensor, no GPU)."""
    def check_optional(name: str, v: Any) -> Any:
        return None if v is None else check(name, v)
    return check_optional


def boolean(name: str, v: Any) -> bool:
    if type(v) is not bool:
        raise ProtocolError(f"{name} must be true or false, got {_short(v)}")
    return v


def text(regex: Optional[re.Pattern] = None, maxlen: int = 1024, empty: bool = False):
    def check(name: str, v: Any) -> str:
        if not isinstance(v, str) or len(v) > maxlen:
            raise ProtocolError(f"{name} must be a string of at most {maxlen} characters, got {_short(v)}")
        if regex is not None and not (empty and v == "") and not regex.match(v):
            raise ProtocolError(f"{name} has characters or a length not allowed: {_short(v)}")
        return v
    return check


def secret_bytes(empty: bool):
    def check(name: str, v: Any) -> bytes:
        lo, hi = SECRET_BYTES
        if not isinstance(v, bytes) or not (lo <= len(v) <= hi or (empty and v == b"")):
            raise ProtocolError(f"{name} must be {lo}-{hi} bytes")
        return v
    return check


def token_ids(maxlen: int):
    def check(name: str, v: Any) -> list[int]:
        if not isinstance(v, list) or len(v) > maxlen:
            raise ProtocolError(f"{name} must be a list of at most {maxlen} token ids")
        for t in v:
            if type(t) is not int or not 0 <= t < MAX_VOCAB:
                raise ProtocolError(f"{name} holds {_short(t)}, not a token id in [0, {MAX_VOCAB})")
        return v
    return check


def raw_bytes(lo: int, hi: int):
    def check(name: str, v: Any) -> bytes:
        if not isinstance(v, bytes) or not lo <= len(v) <= hi:
            raise ProtocolError(f"{name} must be {lo}-{hi} bytes")
        return v
    return check


SHA256 = text(re.compile(r"[0-9a-f]{64}\Z"), 64)    # a sha256 hex digest, lower case


def id_list(name: str, v: Any) -> list[str]:
    if not isinstance(v, list) or len(v) > 256:
        raise ProtocolError(f"{name} must be a list of at most 256 ids")
    return [check_id(x, name) for x in v]


def ids(limit: int) -> Callable[[str, Any], list[str]]:
    """A list of at most `limit` ids (id_list's cap, 256, is too small for a service's sessions)."""
    def check(name: str, v: Any) -> list[str]:
        if not isinstance(v, list) or len(v) > limit:
            raise ProtocolError(f"{name} must be a list of at most {limit} ids")
        return [check_id(x, name) for x in v]
    return check


def check_sampling(name: str, v: Any) -> dict:
    if not isinstance(v, dict) or set(v) != {"temperature", "top_k", "top_p", "seed"}:
        raise ProtocolError(f"{name} must map exactly temperature, top_k, top_p, seed; got {_short(v)}")
    out = {"temperature": number(0.0, MAX_TEMPERATURE)(f"{name}.temperature", v["temperature"]),
           "top_k": integer(0, MAX_TOP_K)(f"{name}.top_k", v["top_k"]),
           "top_p": number(0.0, 1.0)(f"{name}.top_p", v["top_p"]),
           "seed": None if v["seed"] is None else integer(0, MAX_SEQ)(f"{name}.seed", v["seed"])}
    if out["top_p"] <= 0.0:
        raise ProtocolError(f"{name}.top_p must be > 0")
    return out


def new_secret() -> bytes:
    return _secrets.token_bytes(32)


def new_sid() -> str:
    return _secrets.token_hex(8)


def sampling(temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
             seed: Optional[int] = None) -> dict:
    """A sampling dict; temperature 0 means greedy, top_k 0 means no top-k cut."""
    return check_sampling("sampling", {"temperature": temperature, "top_k": top_k, "top_p": top_p,
                                       "seed": seed})


def encode_array(a: np.ndarray) -> list:
    """[dtype, shape, bytes], little-endian, C order."""
    a = np.ascontiguousarray(a)
    a = a.astype(a.dtype.newbyteorder("<"), copy=False)
    if a.dtype.str not in ARRAY_DTYPES:
        raise ProtocolError(f"array dtype {a.dtype} is not one of {ARRAY_DTYPES}")
    return [a.dtype.str, list(a.shape), a.tobytes()]


def decode_array(v: Any, name: str, dtypes: tuple = ARRAY_DTYPES, ndim: int = 1,
                 max_items: int = MAX_TOP_K) -> np.ndarray:
    if not (isinstance(v, list) and len(v) == 3 and isinstance(v[0], str)
            and isinstance(v[1], list) and isinstance(v[2], bytes)):
        raise ProtocolError(f"{name} must be [dtype, shape, bytes]")
    dt, shape, raw = v
    if dt not in dtypes:
        raise ProtocolError(f"{name} has dtype {dt!r}; allowed: {dtypes}")
    if len(shape) != ndim or any(type(d) is not int or d < 0 for d in shape):
        raise ProtocolError(f"{name} must have {ndim} non-negative dimensions, got {_short(shape)}")
    n = math.prod(shape)
    if n > max_items:
        raise ProtocolError(f"{name} holds {n} items; at most {max_items}")
    if len(raw) != n * np.dtype(dt).itemsize:
        raise ProtocolError(f"{name}: {len(raw)} bytes do not match shape {shape} of {dt}")
    return np.frombuffer(raw, dtype=np.dtype(dt)).reshape(shape).copy()


def sparse_q(name: str, v: Any) -> Optional[tuple]:
    """q on the wire: null, or [indices, probs, lengths] — every position's
    entries concatenated, so checking costs a few numpy calls for any gamma."""
    if v is None:
        return None
    if not isinstance(v, list) or len(v) != 3:
        raise ProtocolError(f"{name} must be null or [indices, probs, lengths]")
    n_max = MAX_GAMMA * MAX_TOP_K
    lens = decode_array(v[2], f"{name}.lengths", ("<i4", "<i8"), max_items=MAX_GAMMA)
    idx = decode_array(v[0], f"{name}.indices", ("<i4", "<i8"), max_items=n_max)
    pr = decode_array(v[1], f"{name}.probs", ("<f4", "<f8"), max_items=n_max)
    if lens.size and (lens.min() < 1 or lens.max() > MAX_TOP_K):
        raise ProtocolError(f"{name}: every position needs 1..{MAX_TOP_K} entries")
    if idx.size != pr.size or idx.size != int(lens.sum()):
        raise ProtocolError(f"{name}: indices, probs and lengths do not add up")
    if idx.size and (idx.min() < 0 or idx.max() >= MAX_VOCAB):
        raise ProtocolError(f"{name}.indices must be token ids in [0, {MAX_VOCAB})")
    if idx.size and not (pr.min() >= 0.0 and pr.max() <= 1.0):   # NaN fails both
        raise ProtocolError(f"{name}.probs must be finite and in [0, 1]")
    starts = np.concatenate(([0], np.cumsum(lens)[:-1])).astype(np.int64)
    seg = np.repeat(np.arange(lens.size), lens)
    if np.unique(seg * MAX_VOCAB + idx).size != idx.size:
        raise ProtocolError(f"{name}.indices repeat a token within one position")
    if lens.size and np.abs(np.add.reduceat(pr.astype(np.float64), starts) - 1.0).max() > Q_SUM_TOLERANCE:
        raise ProtocolError(f"{name}: each position's probs must sum to 1 (the exact q sampled from)")
    return idx, pr, lens, starts, seg


def split_q(q: tuple, tokens: list[int]) -> list[QEntry]:
    idx, pr, lens, starts, seg = q
    if lens.size != len(tokens):
        raise ProtocolError("draft_resp.q must have one entry per drafted token")
    hit = (idx == np.asarray(tokens, dtype=np.int64)[seg]) & (pr > 0)
    bad = np.flatnonzero(np.bincount(seg[hit], minlength=lens.size) != 1)
    if bad.size:
        i = int(bad[0])
        raise ProtocolError(f"draft_resp token {i} ({tokens[i]}) has no positive probability in its q")
    return [(idx[a:a + n], pr[a:a + n]) for a, n in zip(starts.tolist(), lens.tolist())]


def wire_q(q: Optional[list]) -> Optional[list]:
    if q is None:
        return None
    if not q:
        return [encode_array(np.zeros(0, np.int64)), encode_array(np.zeros(0, np.float32)),
                encode_array(np.zeros(0, np.int64))]
    idx = [np.asarray(i).reshape(-1) for i, _ in q]
    pr = [np.asarray(p).reshape(-1) for _, p in q]
    return [encode_array(np.concatenate(idx)), encode_array(np.concatenate(pr)),
            encode_array(np.array([a.size for a in idx], dtype=np.int64))]


def grammar_text(name: str, v: Any) -> str:
    """A grammar's text ("" for none), at most MAX_GRAMMAR_BYTES of UTF-8: the size cap every
    receiver holds before it compiles anything."""
    if not isinstance(v, str):
        raise ProtocolError(f"{name} must be a string (a grammar's text), got {_short(v)}")
    n = len(v.encode("utf-8", "surrogatepass"))
    if n > MAX_GRAMMAR_BYTES:
        raise ProtocolError(f"{name} is {n} bytes, over the limit of {MAX_GRAMMAR_BYTES}", "size")
    return v


def as_token_list(v: Any) -> Any:
    """numpy ints and tuples are welcome on the sending side; the wire carries plain ints."""
    return [int(t) for t in v] if isinstance(v, (list, tuple, np.ndarray)) else v


def _short(v: Any) -> str:
    s = repr(v)
    return s if len(s) <= 60 else s[:57] + "..."


FINGERPRINT = text(_FP, 128)
ID = text(_ID, 64)
ID_OR_EMPTY = text(_ID, 64, empty=True)
TOPIC = text(None, 256)
MESSAGE_TEXT = text(None, 1024)
CODE = text(_CODE, 32)
SEQ = integer(0, MAX_SEQ)
VOCAB_SIZE = integer(1, MAX_VOCAB)
GAMMA = integer(0, MAX_GAMMA)
GRAMMAR_ID = text(re.compile(r"[0-9a-f]{16}\Z"), 16, empty=True)   # sha256 of the text, 16 hex digits
