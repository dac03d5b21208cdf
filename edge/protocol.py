"""StarSD wire format: messages, topics, msgpack codec, HMAC, strict validation.

Every message travels as a msgpack map (an *envelope*):

    {"v": PROTOCOL_VERSION, "t": type tag, "s": session id or "",
     "b": msgpack bytes of the body map, "h": HMAC-SHA256 or b""}

The HMAC covers version, tag, sid and body bytes, keyed with the session
secret, so a message cannot be forged, altered or moved to another session by
anyone who does not hold the secret. Session messages (DraftRequest,
DraftResponse, Bye, Error) must be signed; control messages (Join, Joined,
HubStatus, DraftHello, SessionAssign, SessionRelease) travel unsigned unless
the caller passes a key. The body is unpacked only after the HMAC checks.
Arrays travel as [dtype, shape, bytes] with an allow-list of little-endian
dtypes. Nothing is ever pickled.

Confidentiality of the secrets in Joined and SessionAssign comes from the
broker: with the hub's Mosquitto ACL only the addressed client (or draft
service) can read its reply topic. On a broker without ACLs any subscriber to
`#` could read them; signatures then still stop everyone else.

Topics (MQTT 3.1.1: replies go to topics, never v5 properties):

    ss/hub/join/{client}          target -> hub      Join (topic names the sender;
                                                     the ACL lets a client write only its own)
    ss/c/{client}/joined          hub -> target      Joined
    ss/s/{client}/{sid}/{svc}/up   target -> draft   DraftRequest, Bye (signed)
    ss/s/{client}/{sid}/{svc}/down draft -> target   DraftResponse, Error (signed)
                                                     ({svc}: the draft service the hub assigned;
                                                     the ACL lets a service read only its own)
    ss/hub/status                 hub, retained      HubStatus (last will: online=False)
    ss/hub/drafts/{service}       draft svc -> hub   DraftHello, retained (will: online=False)
    ss/d/{service}/ctl            hub -> draft svc   SessionAssign, SessionRelease

SUN (prefill workers -> one shared decoder pool; server/sun_router.py routes):

    ss/sun/req/{client}           client -> router   SunRequest (unsigned, like Join; it
                                                     carries the request's secret)
    ss/sun/workers/{worker}       worker -> router   SunHello, retained (will: online=False)
    ss/sun/w/{worker}/ctl         router -> worker   PrefillJob / DecodeAssign (ctl key)
    ss/sun/w/{decoder}/kv         prefill -> decoder KVChunk, Error (signed, request secret)
    ss/sun/r/{client}/{rid}       workers -> client  SunTokens, Error (signed, request secret)

SUN keys: every request has its own secret, drawn by the client and sent in
SunRequest (confidential under the ACL, as Joined's secret is); the router
passes it on in PrefillJob and DecodeAssign. KV chunks, streamed tokens and
errors are signed with it (their envelope "s" is the request id), so nobody
without it can inject a KV cache into a request or forge its tokens. Router
<-> worker control (SunHello, PrefillJob, DecodeAssign) is signed with the
deployment's ctl key when one is configured, like DraftHello/SessionAssign.
KV blobs are larger than MAX_MESSAGE_BYTES for real prompts (SmolLM2-135M:
~23 KB per token in fp16), so they travel in KVChunks of at most
SUN_CHUNK_BYTES each; every message stays under the one size limit.
"""
from __future__ import annotations

import hashlib
import hmac
import math
import re
import secrets as _secrets
import struct
import threading
from dataclasses import dataclass, field, fields
from typing import Any, Callable, Optional, Union

import msgpack
import numpy as np

PROTOCOL_VERSION = 1

# ---- limits (a message outside them is refused, never half-processed) ----
MAX_MESSAGE_BYTES = 4 << 20
MAX_GAMMA = 32                 # drafted tokens per request
MAX_APPEND = 32768             # tokens fed in one request (a whole prompt at first)
MAX_KEEP = 1 << 20             # longest sequence a draft may be asked to keep
MAX_VOCAB = 1 << 20            # token ids and vocab sizes stay below this
MAX_TOP_K = 4096               # top-k parameter and q entries per position
MAX_TEMPERATURE = 100.0
MAX_SEQ = (1 << 63) - 1
SECRET_BYTES = (16, 64)        # allowed secret lengths
Q_SUM_TOLERANCE = 1e-3         # q must be a distribution: sum within this of 1
ARRAY_DTYPES = ("<i4", "<i8", "<f4", "<f8")

_ID = re.compile(r"[A-Za-z0-9_.\-]{1,64}\Z")
_FP = re.compile(r"[A-Za-z0-9_.:\-]{1,128}\Z")
_CODE = re.compile(r"[a-z0-9_]{1,32}\Z")
JOIN_ROLES = ("target", "prefill", "decoder")  # SUN roles reserved, not served yet

# Error codes a draft service sends back (Error.code).
E_BAD_KEEP = "bad_keep"                 # keep > what the draft holds for the session
E_UNKNOWN_SESSION = "unknown_session"   # evicted or never assigned: rejoin
E_OVERLOADED = "overloaded"             # session / KV limits reached
E_BAD_REQUEST = "bad_request"
E_INTERNAL = "internal"
E_UNKNOWN_TASK = "unknown_task"         # SUN: no prefill worker serves the task
E_NO_DECODER = "no_decoder"             # SUN: no decoder fits the task's KV (fingerprint / pool)
E_REFUSED = "refused"                   # SUN: the decoder refused the KV blob (reason in message)
E_TIMEOUT = "timeout"                   # SUN: the KV cache never arrived at the decoder
E_WORKER_LOST = "worker_lost"           # SUN: the request's decoder went offline mid-request: resend

# ---- SUN limits ----
SUN_CHUNK_BYTES = 2 << 20      # KV bytes per KVChunk (well under MAX_MESSAGE_BYTES)
MAX_KV_CHUNKS = 4096           # 8 GiB: any receiver applies its own, smaller memory limit
MAX_NEW_TOKENS = 1 << 16       # tokens one SUN request may ask for
MAX_STOP = 64                  # stop token ids per request
MAX_STREAM_TOKENS = 256        # tokens in one SunTokens message
SUN_ROLES = ("prefill", "decoder")
FINISH_REASONS = ("stop", "length", "context")


class ProtocolError(ValueError):
    """A message that must be dropped. `code` groups reasons for counters:
    'size', 'format', 'version', 'auth', 'invalid'."""

    def __init__(self, reason: str, code: str = "invalid"):
        super().__init__(reason)
        self.reason = reason
        self.code = code


# ---- topics ----
SUN_PREFIX = "ss/sun"                     # reserved: SUN prefill/decoder routing
STATUS_TOPIC = "ss/hub/status"
JOIN_SUB = "ss/hub/join/+"                # the hub subscribes here
DRAFTS_SUB = "ss/hub/drafts/+"            # the hub watches draft services here


def check_id(value: Any, what: str = "id") -> str:
    """Client, service and session ids: 1-64 chars of [A-Za-z0-9_.-] (no / + # $)."""
    if not isinstance(value, str) or not _ID.match(value):
        raise ProtocolError(f"{what} must be 1-64 characters of A-Z a-z 0-9 _ . -, got {value!r}")
    return value


def join_topic(client: str) -> str:
    return f"ss/hub/join/{check_id(client, 'client id')}"


def joined_topic(client: str) -> str:
    return f"ss/c/{check_id(client, 'client id')}/joined"


def _session(client: str, sid: str, service: str) -> str:
    return f"ss/s/{check_id(client, 'client id')}/{check_id(sid, 'session id')}/{check_id(service, 'service id')}"


def up_topic(client: str, sid: str, service: str) -> str:
    return _session(client, sid, service) + "/up"


def down_topic(client: str, sid: str, service: str) -> str:
    return _session(client, sid, service) + "/down"


def session_up_sub(service: str) -> str:
    """What a draft service subscribes to: the up topics of the sessions assigned to it."""
    return f"ss/s/+/+/{check_id(service, 'service id')}/up"


def draft_hello_topic(service: str) -> str:
    return f"ss/hub/drafts/{check_id(service, 'service id')}"


def draft_ctl_topic(service: str) -> str:
    return f"ss/d/{check_id(service, 'service id')}/ctl"


SUN_REQ_SUB = f"{SUN_PREFIX}/req/+"         # the router subscribes here
SUN_WORKERS_SUB = f"{SUN_PREFIX}/workers/+"  # the router watches SUN workers here


def sun_req_topic(client: str) -> str:
    return f"{SUN_PREFIX}/req/{check_id(client, 'client id')}"


def sun_stream_topic(client: str, rid: str) -> str:
    return f"{SUN_PREFIX}/r/{check_id(client, 'client id')}/{check_id(rid, 'request id')}"


def sun_stream_sub(client: str) -> str:
    return f"{SUN_PREFIX}/r/{check_id(client, 'client id')}/+"


def sun_hello_topic(worker: str) -> str:
    return f"{SUN_PREFIX}/workers/{check_id(worker, 'worker id')}"


def sun_ctl_topic(worker: str) -> str:
    return f"{SUN_PREFIX}/w/{check_id(worker, 'worker id')}/ctl"


def sun_kv_topic(worker: str) -> str:
    return f"{SUN_PREFIX}/w/{check_id(worker, 'worker id')}/kv"


def parse_topic(topic: str) -> tuple[str, dict[str, str]]:
    """(kind, ids) for a StarSD topic: kind in join, joined, up, down, status,
    draft_hello, draft_ctl, sun_req, sun_stream, sun_hello, sun_ctl, sun_kv;
    raises ProtocolError for anything else."""
    p = topic.split("/")
    try:
        if p[:3] == ["ss", "hub", "join"] and len(p) == 4:
            return "join", {"client": check_id(p[3])}
        if p[:2] == ["ss", "c"] and len(p) == 4 and p[3] == "joined":
            return "joined", {"client": check_id(p[2])}
        if p[:2] == ["ss", "s"] and len(p) == 6 and p[5] in ("up", "down"):
            return p[5], {"client": check_id(p[2]), "sid": check_id(p[3]), "service": check_id(p[4])}
        if topic == STATUS_TOPIC:
            return "status", {}
        if p[:3] == ["ss", "hub", "drafts"] and len(p) == 4:
            return "draft_hello", {"service": check_id(p[3])}
        if p[:2] == ["ss", "d"] and len(p) == 4 and p[3] == "ctl":
            return "draft_ctl", {"service": check_id(p[2])}
        if p[:2] == ["ss", "sun"] and len(p) == 4 and p[2] == "req":
            return "sun_req", {"client": check_id(p[3])}
        if p[:2] == ["ss", "sun"] and len(p) == 4 and p[2] == "workers":
            return "sun_hello", {"worker": check_id(p[3])}
        if p[:3] == ["ss", "sun", "w"] and len(p) == 5 and p[4] in ("ctl", "kv"):
            return f"sun_{p[4]}", {"worker": check_id(p[3])}
        if p[:3] == ["ss", "sun", "r"] and len(p) == 5:
            return "sun_stream", {"client": check_id(p[3]), "rid": check_id(p[4])}
    except ProtocolError:
        pass
    raise ProtocolError(f"not a StarSD topic: {topic!r}", "format")


def new_secret() -> bytes:
    return _secrets.token_bytes(32)


def new_sid() -> str:
    return _secrets.token_hex(8)


def sampling(temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
             seed: Optional[int] = None) -> dict:
    """A sampling dict; temperature 0 means greedy, top_k 0 means no top-k cut."""
    return _check_sampling({"temperature": temperature, "top_k": top_k, "top_p": top_p, "seed": seed})


# ---- messages ----
QEntry = tuple[np.ndarray, np.ndarray]      # (token indices, probabilities)


@dataclass
class Join:
    client: str
    model_fp: str                           # tokenizer fingerprint
    vocab_size: int
    gamma: int = 4
    sampling: dict = field(default_factory=lambda: sampling())
    role: str = "target"
    nonce: str = ""                         # echoed in Joined so stale replies are ignored


@dataclass
class Joined:
    client: str
    accepted: bool
    reason: str = ""
    sid: str = ""
    secret: bytes = b""
    draft: str = ""                         # draft service id that serves the session
    up: str = ""
    down: str = ""
    nonce: str = ""


@dataclass
class DraftRequest:
    sid: str
    seq: int
    keep: int                               # draft keeps its first `keep` tokens
    append: list[int]                       # then feeds these
    gamma: int                              # then drafts this many
    sampling: dict = field(default_factory=lambda: sampling())


@dataclass
class DraftResponse:
    sid: str
    seq: int
    tokens: list[int]
    q: Optional[list[QEntry]] = None        # None for greedy; else exact sparse q per token
    compute_us: int = 0                     # draft time spent on it: round trip - this = overhead


@dataclass
class Bye:
    sid: str


@dataclass
class Error:
    sid: str
    seq: int
    code: str
    message: str = ""


@dataclass
class HubStatus:
    hub: str
    online: bool
    time: float = 0.0
    sessions: int = 0
    services: list[str] = field(default_factory=list)


@dataclass
class DraftHello:
    service: str
    model_fp: str
    vocab_size: int
    online: bool = True
    max_sessions: int = 64
    max_gamma: int = 8
    sessions: int = 0
    busy: float = 0.0                       # busy ratio over the last window


@dataclass
class SessionAssign:
    service: str
    client: str
    sid: str
    secret: bytes
    gamma: int
    sampling: dict = field(default_factory=lambda: sampling())


@dataclass
class SessionRelease:
    service: str
    sid: str
    reason: str = ""


# ---- SUN messages ----


@dataclass
class SunRequest:
    client: str
    rid: str                                # request id, chosen by the client
    task: str                               # names the specialist (prefill worker) to use
    prompt: list[int]
    max_new: int = 64                       # answer tokens, the prefill's first one included
    sampling: dict = field(default_factory=lambda: sampling())
    stop: list[int] = field(default_factory=list)
    secret: bytes = b""                     # the request's key: signs its KV and its tokens


@dataclass
class SunHello:
    worker: str
    role: str                               # "prefill" or "decoder"
    task: str                               # prefill: the task served; decoder: ""
    fingerprint: str                        # the decoder the KV is made for / this decoder is
    vocab_size: int
    online: bool = True
    load: int = 0                           # decoder: running + awaited sequences; prefill: queued jobs
    capacity: int = 64                      # decoder: max batch
    served: int = 0                         # jobs / assignments received so far (in-flight accounting)


@dataclass
class PrefillJob:
    worker: str
    rid: str
    client: str
    secret: bytes
    task: str
    prompt: list[int]
    sampling: dict = field(default_factory=lambda: sampling())
    decoder: str = ""                       # where the KV goes


@dataclass
class DecodeAssign:
    worker: str
    rid: str
    client: str
    secret: bytes
    task: str
    max_new: int = 64
    sampling: dict = field(default_factory=lambda: sampling())
    stop: list[int] = field(default_factory=list)
    prefill: str = ""                       # who sends the KV (for error messages)


@dataclass
class KVChunk:
    rid: str
    index: int
    total: int
    first_token: int
    data: bytes


@dataclass
class SunTokens:
    rid: str
    seq: int                                # per sender; the receiver accepts each once
    index: int                              # answer position of tokens[0] (0 = the prefill's token)
    tokens: list[int]
    done: bool = False
    finish_reason: str = ""                 # "stop", "length" or "context" when done
    worker: str = ""                        # who produced them


Message = Union[Join, Joined, DraftRequest, DraftResponse, Bye, Error, HubStatus,
                DraftHello, SessionAssign, SessionRelease, SunRequest, SunHello, PrefillJob,
                DecodeAssign, KVChunk, SunTokens]

# ---- field checkers: take a wire value, return the python value or raise ----


def _int(lo: int, hi: int) -> Callable[[str, Any], int]:
    def check(name: str, v: Any) -> int:
        if type(v) is not int or not lo <= v <= hi:
            raise ProtocolError(f"{name} must be an integer in [{lo}, {hi}], got {_short(v)}")
        return v
    return check


def _float(lo: float, hi: float) -> Callable[[str, Any], float]:
    def check(name: str, v: Any) -> float:
        if type(v) not in (int, float) or not math.isfinite(v) or not lo <= v <= hi:
            raise ProtocolError(f"{name} must be a finite number in [{lo}, {hi}], got {_short(v)}")
        return float(v)
    return check


def _bool(name: str, v: Any) -> bool:
    if type(v) is not bool:
        raise ProtocolError(f"{name} must be true or false, got {_short(v)}")
    return v


def _str(regex: Optional[re.Pattern] = None, maxlen: int = 1024, empty: bool = False):
    def check(name: str, v: Any) -> str:
        if not isinstance(v, str) or len(v) > maxlen:
            raise ProtocolError(f"{name} must be a string of at most {maxlen} characters, got {_short(v)}")
        if regex is not None and not (empty and v == "") and not regex.match(v):
            raise ProtocolError(f"{name} has characters or a length not allowed: {_short(v)}")
        return v
    return check


def _secret(empty: bool):
    def check(name: str, v: Any) -> bytes:
        lo, hi = SECRET_BYTES
        if not isinstance(v, bytes) or not (lo <= len(v) <= hi or (empty and v == b"")):
            raise ProtocolError(f"{name} must be {lo}-{hi} bytes")
        return v
    return check


def _tokens(maxlen: int):
    def check(name: str, v: Any) -> list[int]:
        if not isinstance(v, list) or len(v) > maxlen:
            raise ProtocolError(f"{name} must be a list of at most {maxlen} token ids")
        for t in v:
            if type(t) is not int or not 0 <= t < MAX_VOCAB:
                raise ProtocolError(f"{name} holds {_short(t)}, not a token id in [0, {MAX_VOCAB})")
        return v
    return check


def _bytes(lo: int, hi: int):
    def check(name: str, v: Any) -> bytes:
        if not isinstance(v, bytes) or not lo <= len(v) <= hi:
            raise ProtocolError(f"{name} must be {lo}-{hi} bytes")
        return v
    return check


def _ids(name: str, v: Any) -> list[str]:
    if not isinstance(v, list) or len(v) > 256:
        raise ProtocolError(f"{name} must be a list of at most 256 ids")
    return [check_id(x, name) for x in v]


def _check_sampling(v: Any, name: str = "sampling") -> dict:
    if not isinstance(v, dict) or set(v) != {"temperature", "top_k", "top_p", "seed"}:
        raise ProtocolError(f"{name} must map exactly temperature, top_k, top_p, seed; got {_short(v)}")
    out = {"temperature": _float(0.0, MAX_TEMPERATURE)(f"{name}.temperature", v["temperature"]),
           "top_k": _int(0, MAX_TOP_K)(f"{name}.top_k", v["top_k"]),
           "top_p": _float(0.0, 1.0)(f"{name}.top_p", v["top_p"]),
           "seed": None if v["seed"] is None else _int(0, MAX_SEQ)(f"{name}.seed", v["seed"])}
    if out["top_p"] <= 0.0:
        raise ProtocolError(f"{name}.top_p must be > 0")
    return out


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


def _q(name: str, v: Any) -> Optional[tuple]:
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


def _split_q(q: tuple, tokens: list[int]) -> list[QEntry]:
    idx, pr, lens, starts, seg = q
    if lens.size != len(tokens):
        raise ProtocolError("draft_resp.q must have one entry per drafted token")
    hit = (idx == np.asarray(tokens, dtype=np.int64)[seg]) & (pr > 0)
    bad = np.flatnonzero(np.bincount(seg[hit], minlength=lens.size) != 1)
    if bad.size:
        i = int(bad[0])
        raise ProtocolError(f"draft_resp token {i} ({tokens[i]}) has no positive probability in its q")
    return [(idx[a:a + n], pr[a:a + n]) for a, n in zip(starts.tolist(), lens.tolist())]


def _wire_q(q: Optional[list]) -> Optional[list]:
    if q is None:
        return None
    if not q:
        return [encode_array(np.zeros(0, np.int64)), encode_array(np.zeros(0, np.float32)),
                encode_array(np.zeros(0, np.int64))]
    idx = [np.asarray(i).reshape(-1) for i, _ in q]
    pr = [np.asarray(p).reshape(-1) for _, p in q]
    return [encode_array(np.concatenate(idx)), encode_array(np.concatenate(pr)),
            encode_array(np.array([a.size for a in idx], dtype=np.int64))]


_FPS = _str(_FP, 128)
_SID = _str(_ID, 64)
_SID_OR_EMPTY = _str(_ID, 64, empty=True)
_ID_CHECK = _str(_ID, 64)
_TOPIC = _str(None, 256)
_TEXT = _str(None, 1024)
_SAMPLING = lambda name, v: _check_sampling(v, name)  # noqa: E731

# tag, class, is-session-message, field checkers (every field, in order)
_SPECS: dict[type, tuple[str, bool, dict[str, Callable]]] = {
    Join: ("join", False, {
        "client": _ID_CHECK, "model_fp": _FPS, "vocab_size": _int(1, MAX_VOCAB),
        "gamma": _int(0, MAX_GAMMA), "sampling": _SAMPLING,
        "role": _str(re.compile("(?:" + "|".join(JOIN_ROLES) + r")\Z")), "nonce": _str(_ID, 64, empty=True)}),
    Joined: ("joined", False, {
        "client": _ID_CHECK, "accepted": _bool, "reason": _TEXT, "sid": _SID_OR_EMPTY,
        "secret": _secret(empty=True), "draft": _SID_OR_EMPTY, "up": _TOPIC, "down": _TOPIC,
        "nonce": _str(_ID, 64, empty=True)}),
    DraftRequest: ("draft_req", True, {
        "sid": _SID, "seq": _int(0, MAX_SEQ), "keep": _int(0, MAX_KEEP),
        "append": _tokens(MAX_APPEND), "gamma": _int(0, MAX_GAMMA), "sampling": _SAMPLING}),
    DraftResponse: ("draft_resp", True, {
        "sid": _SID, "seq": _int(0, MAX_SEQ), "tokens": _tokens(MAX_GAMMA), "q": _q,
        "compute_us": _int(0, 1 << 40)}),
    Bye: ("bye", True, {"sid": _SID}),
    Error: ("error", True, {"sid": _SID, "seq": _int(0, MAX_SEQ), "code": _str(_CODE, 32),
                            "message": _TEXT}),
    HubStatus: ("status", False, {
        "hub": _ID_CHECK, "online": _bool, "time": _float(0.0, 1e12), "sessions": _int(0, 1 << 31),
        "services": _ids}),
    DraftHello: ("draft_hello", False, {
        "service": _ID_CHECK, "model_fp": _FPS, "vocab_size": _int(1, MAX_VOCAB), "online": _bool,
        "max_sessions": _int(0, 1 << 20), "max_gamma": _int(0, MAX_GAMMA),
        "sessions": _int(0, 1 << 20), "busy": _float(0.0, 1.0)}),
    SessionAssign: ("assign", False, {
        "service": _ID_CHECK, "client": _ID_CHECK, "sid": _SID, "secret": _secret(empty=False),
        "gamma": _int(0, MAX_GAMMA), "sampling": _SAMPLING}),
    SessionRelease: ("release", False, {"service": _ID_CHECK, "sid": _SID, "reason": _TEXT}),
}
_SPECS.update({
    SunRequest: ("sun_req", False, {
        "client": _ID_CHECK, "rid": _ID_CHECK, "task": _ID_CHECK, "prompt": _tokens(MAX_APPEND),
        "max_new": _int(1, MAX_NEW_TOKENS), "sampling": _SAMPLING, "stop": _tokens(MAX_STOP),
        "secret": _secret(empty=False)}),
    SunHello: ("sun_hello", False, {
        "worker": _ID_CHECK, "role": _str(re.compile("(?:" + "|".join(SUN_ROLES) + r")\Z")),
        "task": _str(_ID, 64, empty=True), "fingerprint": _FPS, "vocab_size": _int(1, MAX_VOCAB),
        "online": _bool, "load": _int(0, 1 << 20), "capacity": _int(0, 1 << 20),
        "served": _int(0, MAX_SEQ)}),
    PrefillJob: ("sun_prefill", False, {
        "worker": _ID_CHECK, "rid": _ID_CHECK, "client": _ID_CHECK, "secret": _secret(empty=False),
        "task": _ID_CHECK, "prompt": _tokens(MAX_APPEND), "sampling": _SAMPLING, "decoder": _ID_CHECK}),
    DecodeAssign: ("sun_assign", False, {
        "worker": _ID_CHECK, "rid": _ID_CHECK, "client": _ID_CHECK, "secret": _secret(empty=False),
        "task": _ID_CHECK, "max_new": _int(1, MAX_NEW_TOKENS), "sampling": _SAMPLING,
        "stop": _tokens(MAX_STOP), "prefill": _ID_CHECK}),
    KVChunk: ("sun_kv", True, {
        "rid": _ID_CHECK, "index": _int(0, MAX_KV_CHUNKS - 1), "total": _int(1, MAX_KV_CHUNKS),
        "first_token": _int(0, MAX_VOCAB - 1), "data": _bytes(1, SUN_CHUNK_BYTES)}),
    SunTokens: ("sun_tokens", True, {
        "rid": _ID_CHECK, "seq": _int(0, MAX_SEQ), "index": _int(0, MAX_NEW_TOKENS),
        "tokens": _tokens(MAX_STREAM_TOKENS), "done": _bool,
        "finish_reason": _str(re.compile("(?:" + "|".join(FINISH_REASONS) + r")\Z"), 16, empty=True),
        "worker": _str(_ID, 64, empty=True)}),
})
_BY_TAG = {tag: cls for cls, (tag, _, _) in _SPECS.items()}


def _validate(cls: type, body: Any) -> Message:
    tag, _, checks = _SPECS[cls]
    if not isinstance(body, dict) or set(body) != set(checks):
        got = sorted(body) if isinstance(body, dict) else type(body).__name__
        raise ProtocolError(f"{tag} must have fields {sorted(checks)}, got {got}")
    msg = cls(**{k: check(f"{tag}.{k}", body[k]) for k, check in checks.items()})
    if cls is DraftResponse and msg.q is not None:
        msg.q = _split_q(msg.q, msg.tokens)
    if cls is SunHello and (msg.role == "prefill") != bool(msg.task):
        raise ProtocolError("sun_hello: a prefill worker names its task, a decoder names none")
    if cls is KVChunk and msg.index >= msg.total:
        raise ProtocolError(f"sun_kv: chunk {msg.index} of {msg.total} is out of range")
    if cls is SunTokens and msg.done != bool(msg.finish_reason):
        raise ProtocolError("sun_tokens: a finish_reason comes with done, and only then")
    if cls is Joined and msg.accepted:
        if not (msg.sid and msg.secret and msg.draft):
            raise ProtocolError("an accepted joined must carry sid, secret and draft")
        if (msg.up, msg.down) != (up_topic(msg.client, msg.sid, msg.draft), down_topic(msg.client, msg.sid, msg.draft)):
            raise ProtocolError("joined.up/down must be the session's topics ss/s/{client}/{sid}/{draft}/up|down")
    return msg


def _mac(secret: bytes, version: int, tag: str, sid: str, body: bytes) -> bytes:
    head = b"starsun\0" + struct.pack(">H", version) + tag.encode() + b"\0" + sid.encode() + b"\0"
    return hmac.new(secret, head + body, hashlib.sha256).digest()


def _session_of(msg: Message) -> str:
    """The envelope's "s": a session message's sid (StarSD) or rid (SUN request)."""
    if not _SPECS[type(msg)][1]:
        return ""
    return msg.rid if hasattr(msg, "rid") else msg.sid


def encode(msg: Message, secret: Optional[bytes] = None) -> bytes:
    """Validate and pack a message; session messages need the session secret."""
    if type(msg) not in _SPECS:
        raise TypeError(f"not a protocol message: {type(msg).__name__}")
    tag, session, checks = _SPECS[type(msg)]
    body = {f.name: getattr(msg, f.name) for f in fields(msg)}
    for k in ("append", "tokens", "prompt", "stop"):   # numpy ints and tuples are welcome here
        if k in body and isinstance(body[k], (list, tuple, np.ndarray)):
            body[k] = [int(t) for t in body[k]]
    if type(msg) is DraftResponse:
        body["q"] = _wire_q(body["q"])
    _validate(type(msg), body)            # a bad message fails at the sender, with its reason
    if session and not secret:
        raise ProtocolError(f"{tag} is a session message: pass the session secret", "auth")
    raw = msgpack.packb(body, use_bin_type=True)
    sid = _session_of(msg)
    mac = _mac(secret, PROTOCOL_VERSION, tag, sid, raw) if secret else b""
    out = msgpack.packb({"v": PROTOCOL_VERSION, "t": tag, "s": sid, "b": raw, "h": mac}, use_bin_type=True)
    if len(out) > MAX_MESSAGE_BYTES:
        raise ProtocolError(f"{tag} is {len(out)} bytes; at most {MAX_MESSAGE_BYTES}", "size")
    return out


SecretSource = Union[bytes, None, Callable[[str], Optional[bytes]]]


def _unpack(data: bytes, what: str) -> Any:
    def no_ext(code: int, data: bytes) -> Any:
        raise ValueError("msgpack extension types are not allowed")
    try:
        return msgpack.unpackb(data, raw=False, use_list=True, strict_map_key=True,
                               ext_hook=no_ext, timestamp=0)
    except Exception as exc:  # msgpack raises many types; all mean "not ours"
        raise ProtocolError(f"{what} is not valid msgpack: {exc or type(exc).__name__}", "format") from None


def decode(data: bytes, secret: SecretSource = None) -> Message:
    """Unpack, check version and HMAC, validate strictly; raise ProtocolError.

    `secret` is the session key, or a function sid -> key (None if unknown) for
    a receiver serving many sessions. Session messages always need a key;
    control messages are verified only when a key is given."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise ProtocolError("payload must be bytes", "format")
    if len(data) > MAX_MESSAGE_BYTES:
        raise ProtocolError(f"message of {len(data)} bytes; at most {MAX_MESSAGE_BYTES}", "size")
    env = _unpack(bytes(data), "envelope")
    if not isinstance(env, dict) or set(env) != {"v", "t", "s", "b", "h"}:
        raise ProtocolError("envelope must map exactly v, t, s, b, h", "format")
    if env["v"] != PROTOCOL_VERSION:
        raise ProtocolError(f"protocol version {env['v']!r}, this side speaks {PROTOCOL_VERSION}: "
                            "run the same StarSun release on hub and devices", "version")
    tag, sid, raw, mac = env["t"], env["s"], env["b"], env["h"]
    cls = _BY_TAG.get(tag) if isinstance(tag, str) else None
    if cls is None:
        raise ProtocolError(f"unknown message type {_short(tag)}", "format")
    if not isinstance(raw, bytes) or not isinstance(mac, bytes) or not isinstance(sid, str):
        raise ProtocolError("envelope fields have wrong types", "format")
    session = _SPECS[cls][1]
    if session:
        check_id(sid, "session id")
    elif sid != "":
        raise ProtocolError(f"{tag} carries no session id", "format")
    key = secret(sid) if callable(secret) else secret
    if session and not key:
        raise ProtocolError(f"no secret for session {sid!r}: unknown or expired session", "auth")
    if key is not None and not hmac.compare_digest(mac, _mac(key, env["v"], tag, sid, raw)):
        raise ProtocolError(f"{tag} for session {sid!r} has a bad HMAC: dropped", "auth")
    msg = _validate(cls, _unpack(raw, tag))
    if session and _session_of(msg) != sid:
        raise ProtocolError(f"{tag}: body id {_session_of(msg)!r} differs from envelope sid {sid!r}")
    return msg


def check_vocab(msg: Message, vocab_size: int) -> None:
    """Raise if any token id in msg is outside the receiver's vocabulary."""
    ids: list = list(getattr(msg, "append", []) or getattr(msg, "tokens", []) or [])
    if isinstance(msg, DraftResponse) and msg.q:
        ids += [int(i.max()) for i, _ in msg.q]
    if ids and max(ids) >= vocab_size:
        raise ProtocolError(f"token id {max(ids)} is outside the vocabulary of {vocab_size}")


GREEDY = sampling()


class ReplayGuard:
    """Per-session monotonic seq: a seq not above the last accepted one is dropped
    and counted. Thread-safe (MQTT callbacks run on the network thread)."""

    def __init__(self) -> None:
        self._last: dict[str, int] = {}
        self._lock = threading.Lock()
        self.dropped = 0
        self.dropped_by_sid: dict[str, int] = {}

    def accept(self, sid: str, seq: int) -> bool:
        with self._lock:
            if seq <= self._last.get(sid, -1):
                self.dropped += 1
                self.dropped_by_sid[sid] = self.dropped_by_sid.get(sid, 0) + 1
                return False
            self._last[sid] = seq
            return True

    def last(self, sid: str) -> int:
        with self._lock:
            return self._last.get(sid, -1)

    def forget(self, sid: str) -> None:
        with self._lock:
            self._last.pop(sid, None)
            self.dropped_by_sid.pop(sid, None)


def _short(v: Any) -> str:
    s = repr(v)
    return s if len(s) <= 60 else s[:57] + "..."
