"""StarSD / SUN wire format: the message table (the envelope and HMAC: edge/wire/envelope.py; the
topic table: edge/wire/topics.py; the field checks: edge/wire/fields.py; all re-exported here).

Every message travels as a msgpack map (an *envelope*):

    {"v": PROTOCOL_VERSION, "t": type tag, "s": session id or "",
     "b": msgpack bytes of the body map, "h": HMAC-SHA256 or b""}

The HMAC covers version, tag, sid and body bytes, keyed with the session
secret, so a message cannot be forged, altered or moved to another session by
anyone who does not hold the secret. Session messages (`session=True` below)
must be signed; control messages travel unsigned unless the caller passes a
key (the deployment's ctl key). The body is unpacked only after the HMAC
checks, then every field is checked by the checker declared with it
(edge/wire/fields.py) and the message's own cross-field rules. Nothing is ever
pickled. MQTT 3.1.1: replies go to topics, never v5 properties.

Confidentiality of the secrets in Joined, SessionAssign and SunRequest comes
from the broker: with the hub's Mosquitto ACL only the addressed client (or
service) can read them. SUN: every request has its own secret, drawn by the
client; KV chunks, streamed tokens and errors are signed with it (their
envelope "s" is the request id). KV blobs travel in KVChunks of at most
SUN_CHUNK_BYTES, so every message stays under the one size limit.
"""
from __future__ import annotations

import secrets as _secrets
from typing import Optional

from edge.wire.envelope import (MAX_MESSAGE_BYTES, PROTOCOL_VERSION, Message, SecretSource, _BY_TAG, _mac,  # noqa: F401
                           decode, encode, message, wire)

from edge.wire.fields import (CODE, FINGERPRINT, GAMMA, GRAMMAR_ID, ID, ID_OR_EMPTY, MAX_GAMMA,  # noqa: F401
                              MAX_GRAMMAR_BYTES, MAX_SEQ, grammar_text,
                              MAX_TEMPERATURE, MAX_TOP_K, MAX_VOCAB, MESSAGE_TEXT, SECRET_BYTES, SEQ, TOPIC,
                              VOCAB_SIZE, ProtocolError, QEntry, as_token_list, boolean, check_id,
                              check_sampling, decode_array, encode_array, id_list, ids, integer, number, one_of, optional,
                              raw_bytes, secret_bytes, SHA256, sparse_q, split_q, text, token_ids, wire_q, _short)

# the topic table (edge/wire/topics.py) is part of the wire format: its names are used from here too
from edge.wire.topics import (  # noqa: F401,E402
    DRAFTS_SUB, JOIN_SUB, STATUS_TOPIC, SUN_PREFIX, SUN_REQ_SUB, SUN_WORKERS_SUB, TOPICS, down_topic,
    draft_ctl_topic, draft_hello_topic, join_topic, joined_topic, parse_topic, session_up_sub, subscription,
    sun_ctl_topic, sun_hello_topic, sun_kv_sub, sun_kv_topic, sun_req_topic, sun_stream_sub, sun_stream_topic,
    topic, up_topic, TELEMETRY_SUB, telemetry_topic, HUBS_SUB, hub_hello_topic, DISCOVER_TOPIC)


# ---- message limits (the field limits live with the checkers, edge/wire/fields.py) ----
MAX_APPEND = 32768             # tokens fed in one request (a whole prompt at first)
MAX_KEEP = 1 << 20             # longest sequence a draft may be asked to keep
SUN_CHUNK_BYTES = 2 << 20      # KV bytes per KVChunk (well under MAX_MESSAGE_BYTES)
MAX_KV_CHUNKS = 4096           # 8 GiB: any receiver applies its own, smaller memory limit
MAX_NEW_TOKENS = 1 << 16       # tokens one SUN request may ask for
MAX_HELD = 4096               # session ids a DraftHello lists (~70 KB); past it, none
MAX_STOP = 64                  # stop token ids per request
MAX_STREAM_TOKENS = 256        # tokens in one SunTokens message
JOIN_ROLES = ("target", "prefill", "decoder")  # SUN roles reserved, not served yet
SUN_ROLES = ("prefill", "decoder")
TELEMETRY_ROLES = ("target", "draft", "prefill", "decoder", "hub")
FINISH_REASONS = ("stop", "length", "context")

# Error codes (Error.code).
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
E_BAD_GRAMMAR = "bad_grammar"           # StarSD: the draft cannot use the request's grammar (reason in message)

def new_secret() -> bytes:
    return _secrets.token_bytes(32)


def new_sid() -> str:
    return _secrets.token_hex(8)


def sampling(temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
             seed: Optional[int] = None) -> dict:
    """A sampling dict; temperature 0 means greedy, top_k 0 means no top-k cut."""
    return check_sampling("sampling", {"temperature": temperature, "top_k": top_k, "top_p": top_p,
                                       "seed": seed})


# greedy decoding as a sampling dict on the wire (the SamplingParams is edge.spec.sampling.GREEDY)
GREEDY_WIRE = sampling()

# ---- messages: each field declared once, with its checker ----


def _sampling_field():
    return wire(check_sampling, factory=sampling)


def _tokens(limit: int, **kw):
    return wire(token_ids(limit), send=as_token_list, **kw)


@message("join")
class Join(Message):
    client: str = wire(ID)
    model_fp: str = wire(FINGERPRINT)           # tokenizer fingerprint
    vocab_size: int = wire(VOCAB_SIZE)
    gamma: int = wire(GAMMA, 4)
    sampling: dict = _sampling_field()
    role: str = wire(one_of(JOIN_ROLES), "target")
    nonce: str = wire(ID_OR_EMPTY, "")          # echoed in Joined so stale replies are ignored
    hub: str = wire(ID_OR_EMPTY, "")            # the hub it is for, of several (edge/star/hub_ring.py); "": the one


@message("joined")
class Joined(Message):
    client: str = wire(ID)
    accepted: bool = wire(boolean)
    reason: str = wire(MESSAGE_TEXT, "")
    sid: str = wire(ID_OR_EMPTY, "")
    secret: bytes = wire(secret_bytes(empty=True), b"")
    draft: str = wire(ID_OR_EMPTY, "")          # draft service id that serves the session
    up: str = wire(TOPIC, "")
    down: str = wire(TOPIC, "")
    nonce: str = wire(ID_OR_EMPTY, "")

    def check_rules(self) -> None:
        if not self.accepted:
            return
        if not (self.sid and self.secret and self.draft):
            raise ProtocolError("an accepted joined must carry sid, secret and draft")
        if (self.up, self.down) != (up_topic(self.client, self.sid, self.draft),
                                    down_topic(self.client, self.sid, self.draft)):
            raise ProtocolError("joined.up/down must be the session's topics ss/s/{client}/{sid}/{draft}/up|down")


@message("draft_req", session=True)
class DraftRequest(Message):
    sid: str = wire(ID)
    seq: int = wire(SEQ)
    keep: int = wire(integer(0, MAX_KEEP))      # draft keeps its first `keep` tokens
    append: list[int] = _tokens(MAX_APPEND)     # then feeds these
    gamma: int = wire(GAMMA)                    # then drafts this many
    sampling: dict = _sampling_field()
    background: bool = wire(boolean, False)     # a probe: its answer is scored, never verified
    # the target's confidence stop for this answer, used where looser than the service's
    # --draft-p-min (None: the service's): a target whose verify over k tokens costs well under
    # k steps wants the unsure drafts too
    p_min: Optional[float] = wire(optional(number(0.0, 0.999)), None)
    # constrained output (edge/spec/constrained.py): the grammar the drafts follow, named by its id
    # on every request, its text sent until the draft has answered one carrying it; it governs
    # the context from position grammar_from on (the generated part)
    grammar_id: str = wire(GRAMMAR_ID, "")
    grammar: str = wire(grammar_text, "")
    grammar_from: int = wire(integer(0, MAX_KEEP), 0)

    def check_rules(self) -> None:
        if self.grammar and not self.grammar_id:
            raise ProtocolError("draft_req.grammar needs its grammar_id")
        if self.grammar_id and self.grammar_from > self.keep + len(self.append):
            raise ProtocolError("draft_req.grammar_from lies past the context it names")


@message("draft_resp", session=True)
class DraftResponse(Message):
    sid: str = wire(ID)
    seq: int = wire(SEQ)
    tokens: list[int] = _tokens(MAX_GAMMA)
    q: Optional[list[QEntry]] = wire(sparse_q, None, send=wire_q)   # None for greedy; else exact sparse q
    compute_us: int = wire(integer(0, 1 << 40), 0)  # draft time spent: round trip - this = overhead

    def check_rules(self) -> None:
        if self.q is not None:
            self.q = split_q(self.q, self.tokens)


@message("bye", session=True)
class Bye(Message):
    sid: str = wire(ID)


@message("error", session=True)
class Error(Message):
    sid: str = wire(ID)
    seq: int = wire(SEQ)
    code: str = wire(CODE)
    message: str = wire(MESSAGE_TEXT, "")


@message("status")
class HubStatus(Message):
    hub: str = wire(ID)
    online: bool = wire(boolean)
    time: float = wire(number(0.0, 1e12), 0.0)
    sessions: int = wire(integer(0, 1 << 31), 0)
    services: list[str] = wire(id_list, factory=list)


@message("draft_hello")
class DraftHello(Message):
    service: str = wire(ID)
    model_fp: str = wire(FINGERPRINT)
    vocab_size: int = wire(VOCAB_SIZE)
    online: bool = wire(boolean, True)
    max_sessions: int = wire(integer(0, 1 << 20), 64)
    max_gamma: int = wire(GAMMA, 8)
    sessions: int = wire(integer(0, 1 << 20), 0)
    busy: float = wire(number(0.0, 1.0), 0.0)   # busy ratio over the last window
    # The session ids it serves now (None: more than MAX_HELD, not listed): a hub releases a session
    # it assigned that a later hello does not list -- an assignment or a release lost on the way
    # (server/registry.py). `stamp` (the service's wall clock) orders its hellos, so a stale
    # retained copy (RabbitMQ keeps one per node) is not taken for news.
    held: Optional[list] = wire(optional(ids(MAX_HELD)), None)
    stamp: float = wire(number(0.0, 1e12), 0.0)


@message("assign")
class SessionAssign(Message):
    service: str = wire(ID)
    client: str = wire(ID)
    sid: str = wire(ID)
    secret: bytes = wire(secret_bytes(empty=False))
    gamma: int = wire(GAMMA)
    sampling: dict = _sampling_field()


@message("release")
class SessionRelease(Message):
    service: str = wire(ID)
    sid: str = wire(ID)
    reason: str = wire(MESSAGE_TEXT, "")


@message("probe")
class Probe(Message):
    """hub / router -> a service or SUN worker on its ctl topic: publish your hello now. A retained
    hello may be a dead process's (killed before its will, or a broker that kept it); only a hello
    that answers a probe proves the service is alive (server/liveness.py)."""
    target: str = wire(ID)


@message("discover")
class Discover(Message):
    """hub / router -> every service and SUN worker on ss/discover: publish your hello now.

    Discovery that needs no retained message: a clustered broker (RabbitMQ) keeps a retained
    hello on the node it was published on and gives none through a wildcard, so the hub asks
    (at its start, on every reconnect, and periodically) and each live node answers with a fresh
    hello -- which the hub then probes like any first hello (server/liveness.py)."""
    asker: str = wire(ID)


def _reading(hi: float):
    return wire(optional(number(0.0, hi)), None)    # None: this device cannot measure it


@message("telemetry")
class Telemetry(Message):
    """One device's health and load, retained on ss/dev/{client}/telemetry (edge/telemetry/readings.py).

    Memory in MB; rates over the sender's last interval; None where the device has no such
    reading (no GPU, no power sensor) or the role does not know it (KV of a target)."""
    client: str = wire(ID)
    role: str = wire(one_of(TELEMETRY_ROLES))
    time: float = wire(number(0.0, 1e12))       # sender's wall clock (the age `edge-hub top` shows)
    interval: float = wire(number(0.0, 86400.0), 0.0)
    rss_mb: float = wire(number(0.0, 1e9), 0.0)
    mem_avail_mb: float = wire(number(0.0, 1e9), 0.0)
    mem_total_mb: float = wire(number(0.0, 1e9), 0.0)
    kv_used_mb: Optional[float] = _reading(1e9)
    kv_budget_mb: Optional[float] = _reading(1e9)
    cpu_pct: float = wire(number(0.0, 100.0), 0.0)      # whole machine
    gpu_pct: Optional[float] = _reading(100.0)
    temp_c: Optional[float] = wire(optional(number(-273.0, 1000.0)), None)   # hottest sensor
    power_w: Optional[float] = _reading(1e6)
    tokens: int = wire(SEQ, 0)                          # produced since start
    tok_s: float = wire(number(0.0, 1e9), 0.0)
    tok_j: Optional[float] = _reading(1e9)              # tokens per joule: tok_s / power_w
    sessions: int = wire(integer(0, 1 << 31), 0)
    acceptance: Optional[float] = _reading(1.0)
    busy: Optional[float] = _reading(1.0)
    batch_mean: Optional[float] = _reading(1e6)
    batch_max: int = wire(integer(0, 1 << 31), 0)
    dropped: int = wire(SEQ, 0)                         # messages the role dropped (all reasons)
    source: str = wire(text(None, 64), "")              # where the readings came from: psutil, tegrastats, jtop


# ---- SUN messages ----


@message("sun_req")
class SunRequest(Message):
    client: str = wire(ID)
    rid: str = wire(ID)                         # request id, chosen by the client
    task: str = wire(ID)                        # names the specialist (prefill worker) to use
    prompt: list[int] = _tokens(MAX_APPEND)
    max_new: int = wire(integer(1, MAX_NEW_TOKENS), 64)   # answer tokens, the prefill's first included
    sampling: dict = _sampling_field()
    stop: list[int] = _tokens(MAX_STOP, factory=list)
    secret: bytes = wire(secret_bytes(empty=False), factory=new_secret)   # the request's key: signs its KV and tokens


@message("sun_hello")
class SunHello(Message):
    worker: str = wire(ID)
    role: str = wire(one_of(SUN_ROLES))         # "prefill" or "decoder"
    task: str = wire(ID_OR_EMPTY)               # prefill: the task served; decoder: ""
    fingerprint: str = wire(FINGERPRINT)        # the decoder the KV is made for / this decoder is
    vocab_size: int = wire(VOCAB_SIZE)
    online: bool = wire(boolean, True)
    load: int = wire(integer(0, 1 << 20), 0)    # decoder: running + awaited; prefill: queued jobs
    capacity: int = wire(integer(0, 1 << 20), 64)   # decoder: max batch
    served: int = wire(SEQ, 0)                  # jobs / assignments received (in-flight accounting)
    max_load: int = wire(integer(0, 1 << 20), 0)   # the load past which it refuses (0: not said)
    tasks: list[str] = wire(id_list, factory=list)  # prefill with adapters: every task it serves ([]: `task` only)

    def check_rules(self) -> None:
        if (self.role == "prefill") != bool(self.task or self.tasks):
            raise ProtocolError("sun_hello: a prefill worker names its task, a decoder names none")
        if self.tasks and self.task not in self.tasks:
            raise ProtocolError("sun_hello: a worker serving several tasks names one of them as its task")


@message("sun_prefill")
class PrefillJob(Message):
    worker: str = wire(ID)
    rid: str = wire(ID)
    client: str = wire(ID)
    secret: bytes = wire(secret_bytes(empty=False))
    task: str = wire(ID)
    prompt: list[int] = _tokens(MAX_APPEND)
    sampling: dict = _sampling_field()
    decoder: str = wire(ID, kw_only=True)       # where the KV goes (no default: "" is no worker)


@message("sun_assign")
class DecodeAssign(Message):
    worker: str = wire(ID)
    rid: str = wire(ID)
    client: str = wire(ID)
    secret: bytes = wire(secret_bytes(empty=False))
    task: str = wire(ID)
    max_new: int = wire(integer(1, MAX_NEW_TOKENS), 64)
    sampling: dict = _sampling_field()
    stop: list[int] = _tokens(MAX_STOP, factory=list)
    prefill: str = wire(ID, kw_only=True)       # who sends the KV (the decoder holds only its early KV)


@message("sun_kv", session=True, id_field="rid")
class KVChunk(Message):
    rid: str = wire(ID)
    index: int = wire(integer(0, MAX_KV_CHUNKS - 1))
    total: int = wire(integer(1, MAX_KV_CHUNKS))
    first_token: int = wire(integer(0, MAX_VOCAB - 1))
    data: bytes = wire(raw_bytes(1, SUN_CHUNK_BYTES))

    def check_rules(self) -> None:
        if self.index >= self.total:
            raise ProtocolError(f"sun_kv: chunk {self.index} of {self.total} is out of range")


@message("sun_tokens", session=True, id_field="rid")
class SunTokens(Message):
    rid: str = wire(ID)
    seq: int = wire(SEQ)                        # per sender; the receiver accepts each once
    index: int = wire(integer(0, MAX_NEW_TOKENS))   # answer position of tokens[0] (0 = the prefill's)
    tokens: list[int] = _tokens(MAX_STREAM_TOKENS)
    done: bool = wire(boolean, False)
    finish_reason: str = wire(one_of(FINISH_REASONS, 16, empty=True), "")   # when done
    worker: str = wire(ID_OR_EMPTY, "")         # who produced them

    def check_rules(self) -> None:
        if self.done != bool(self.finish_reason):
            raise ProtocolError("sun_tokens: a finish_reason comes with done, and only then")


@message("sun_adapter_add")
class AdapterAdd(Message):
    """operator / hub -> a prefill worker with adapters, on its ctl topic, signed with the ctl key:
    load `task`'s adapter from `path` (an adapter directory or GGUF file, or with `bundle` a bundle
    whose manifest lists `task`) after checking its weights file's sha256. The answer
    (AdapterResult, signed with the ctl key) goes to ss/sun/r/{client}/{rid}."""
    worker: str = wire(ID)
    rid: str = wire(ID)
    client: str = wire(ID)
    task: str = wire(ID)
    path: str = wire(text(None, 4096))
    sha256: str = wire(SHA256)
    bundle: bool = wire(boolean, False)

    def check_rules(self) -> None:
        if not self.path:
            raise ProtocolError("sun_adapter_add: path names the adapter file or bundle")


@message("sun_adapter_result")
class AdapterResult(Message):
    """prefill worker -> the AdapterAdd's sender: loaded (ok) or refused, with why."""
    worker: str = wire(ID)
    rid: str = wire(ID)
    task: str = wire(ID)
    ok: bool = wire(boolean)
    message: str = wire(MESSAGE_TEXT, "")
    tasks: list[str] = wire(id_list, factory=list)     # what the worker serves now


def check_vocab(msg: Message, vocab_size: int) -> None:
    """Raise if any token id in msg is outside the receiver's vocabulary."""
    ids: list = list(getattr(msg, "append", []) or getattr(msg, "tokens", []) or [])
    if isinstance(msg, DraftResponse) and msg.q:
        ids += [int(i.max()) for i, _ in msg.q]
    if ids and max(ids) >= vocab_size:
        raise ProtocolError(f"token id {max(ids)} is outside the vocabulary of {vocab_size}")
