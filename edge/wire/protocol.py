"""StarSD / SUN wire format: the message table (the envelope and HMAC: edge/wire/envelope.py; the
topic table: edge/wire/topics.py; the field checks: edge/wire/field_types.py; limits and error codes:
edge/wire/limits.py; the SUN messages: edge/wire/sun_messages.py; all re-exported here).

Every message travels as a msgpack map (an *envelope*):

    {"v": PROTOCOL_VERSION, "t": type tag, "s": session id or "",
     "b": msgpack bytes of the body map, "h": HMAC-SHA256 or b""}

The HMAC covers version, tag, sid and body bytes, keyed with the session
secret, so a message cannot be forged, altered or moved to another session by
anyone who does not hold the secret. Session messages (`session=True` below)
must be signed; control messages travel unsigned unless the caller passes a
key (the deployment's ctl key). The body is unpacked only after the HMAC
checks, then every field is checked by the checker declared with it
(edge/wire/field_types.py) and the message's own cross-field rules. Nothing is ever
pickled. MQTT 3.1.1: replies go to topics, never v5 properties.

Confidentiality of the secrets in Joined, SessionAssign and SunRequest comes
from the broker: with the hub's Mosquitto ACL only the addressed client (or
service) can read them. SUN: every request has its own secret, drawn by the
client; KV chunks, streamed tokens and errors are signed with it (their
envelope "s" is the request id). KV blobs travel in KVChunks of at most
SUN_CHUNK_BYTES, so every message stays under the one size limit.
"""
from __future__ import annotations

from typing import Optional

from edge.wire.envelope import (MAX_MESSAGE_BYTES, PROTOCOL_VERSION, Message, SecretSource, _BY_TAG, _mac,  # noqa: F401
                           decode, encode, message, sampling_field, tokens_field, wire)

from edge.wire.field_types import (CODE, FINGERPRINT, GAMMA, GRAMMAR_ID, ID, ID_OR_EMPTY, MAX_GAMMA,  # noqa: F401
                              MAX_GRAMMAR_BYTES, MAX_SEQ, grammar_text,
                              MAX_TEMPERATURE, MAX_TOP_K, MAX_VOCAB, MESSAGE_TEXT, SECRET_BYTES, SEQ, TOPIC,
                              VOCAB_SIZE, ProtocolError, QEntry, as_token_list, boolean, check_id,
                              check_sampling, decode_array, encode_array, id_list, ids, integer, number, one_of, optional,
                              new_secret, new_sid, raw_bytes, sampling, secret_bytes, SHA256, sparse_q, split_q, text, token_ids, wire_q, _short)

# the topic table (edge/wire/topics.py) is part of the wire format: its names are used from here too
from edge.wire.topics import (  # noqa: F401,E402
    DRAFTS_SUB, JOIN_SUB, STATUS_TOPIC, SUN_PREFIX, SUN_REQ_SUB, SUN_WORKERS_SUB, TOPICS, down_topic,
    draft_ctl_topic, draft_hello_topic, join_topic, joined_topic, parse_topic, session_up_sub, subscription,
    sun_ctl_topic, sun_hello_topic, sun_kv_sub, sun_kv_topic, sun_req_topic, sun_stream_sub, sun_stream_topic,
    topic, up_topic, TELEMETRY_SUB, telemetry_topic, HUBS_SUB, hub_hello_topic, DISCOVER_TOPIC,
    verify_hello_topic, VERIFIERS_SUB)


# the limits and error codes (edge/wire/limits.py) are part of the wire format: used from here too
from edge.wire.limits import (  # noqa: F401,E402
    MAX_APPEND, MAX_KEEP, SUN_CHUNK_BYTES, MAX_KV_CHUNKS,
    MAX_NEW_TOKENS, MAX_HELD, MAX_ENDED, MAX_STOP, MAX_STREAM_TOKENS, JOIN_ROLES, SUN_ROLES, TELEMETRY_ROLES,
    FINISH_REASONS, E_CONTEXT_FULL, E_BAD_KEEP, E_UNKNOWN_SESSION, E_OVERLOADED, E_BAD_REQUEST, E_INTERNAL, E_UNKNOWN_TASK,
    E_NO_DECODER, E_REFUSED, E_TIMEOUT, E_WORKER_LOST, E_BAD_GRAMMAR)


# greedy decoding as a sampling dict on the wire (the SamplingParams is edge.speculative.sampling.GREEDY)
GREEDY_WIRE = sampling()

# ---- messages: each field declared once, with its checker ----


@message("join")
class Join(Message):
    client: str = wire(ID)
    model_fp: str = wire(FINGERPRINT)           # tokenizer fingerprint
    vocab_size: int = wire(VOCAB_SIZE)
    gamma: int = wire(GAMMA, 4)
    sampling: dict = sampling_field()
    role: str = wire(one_of(JOIN_ROLES), "target")
    nonce: str = wire(ID_OR_EMPTY, "")          # echoed in Joined so stale replies are ignored
    hub: str = wire(ID_OR_EMPTY, "")            # the hub it is for, of several (edge/star/hub_ring.py); "": the one
    # Sessions this client ended (its bye went to their draft service, which tells the hub only after its
    # loop handled it): the hub releases those of this client before it counts them, so back-to-back
    # requests are not refused for sessions already gone (server/join_ended.py).
    ended: list = wire(ids(MAX_ENDED), factory=list)


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
    append: list[int] = tokens_field(MAX_APPEND)     # then feeds these
    gamma: int = wire(GAMMA)                    # then drafts this many
    sampling: dict = sampling_field()
    background: bool = wire(boolean, False)     # a probe: its answer is scored, never verified
    # the target's confidence stop for this answer, used where looser than the service's
    # --draft-p-min (None: the service's): a target whose verify over k tokens costs well under
    # k steps wants the unsure drafts too
    p_min: Optional[float] = wire(optional(number(0.0, 0.999)), None)
    # constrained output (edge/speculative/constrained.py): the grammar the drafts follow, named by its id
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
    tokens: list[int] = tokens_field(MAX_GAMMA)
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
    sampling: dict = sampling_field()


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


# the SUN messages (edge/wire/sun_messages.py), registered with the others on import
from edge.wire.sun_messages import (  # noqa: F401,E402
    SunRequest, SunHello, PrefillJob, DecodeAssign,
    KVChunk, SunTokens, AdapterAdd, AdapterResult)
# the reverse star's (edge/wire/reverse_messages.py): a drafting device's drafts, the hub's verdict
from edge.wire.reverse_messages import VerifyRequest, VerifyResponse, check_reverse_vocab  # noqa: F401,E402


def check_vocab(msg: Message, vocab_size: int) -> None:
    """Raise if any token id in msg is outside the receiver's vocabulary."""
    ids: list = list(getattr(msg, "append", []) or getattr(msg, "tokens", []) or [])
    if isinstance(msg, DraftResponse) and msg.q:
        ids += [int(i.max()) for i, _ in msg.q]
    if ids and max(ids) >= vocab_size:
        raise ProtocolError(f"token id {max(ids)} is outside the vocabulary of {vocab_size}")
    check_reverse_vocab(msg, vocab_size)
