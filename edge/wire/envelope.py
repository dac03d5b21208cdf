"""The envelope of every StarSD / SUN message: the message base and registry, msgpack, HMAC.

    {"v": PROTOCOL_VERSION, "t": type tag, "s": session id or "",
     "b": msgpack bytes of the body map, "h": HMAC-SHA256 or b""}

The HMAC covers version, tag, sid and body bytes, keyed with the session secret. The body
is unpacked only after the HMAC checks, then every field is checked by the checker declared
with it (edge/wire/field_types.py) and the message's own cross-field rules. Nothing is ever
pickled. The messages themselves are declared in edge/wire/protocol.py, which re-exports all this.
"""
from __future__ import annotations

import hashlib
import hmac
import struct
from dataclasses import MISSING, dataclass, field, fields
from typing import Any, Callable, ClassVar, Optional, Union

import msgpack

from edge.wire.field_types import ProtocolError, _short, as_token_list, check_id, check_sampling, sampling, token_ids

PROTOCOL_VERSION = 14         # 2: SUN KV topics name their sender; 3: SunHello carries max_load;
                              # 4: DraftRequest carries background; 5: and the target's p_min;
                              # 6: and the grammar its drafts follow (grammar_id, grammar, grammar_from);
                              # 7: Join names the hub it is for (several hubs);
                              # 8: SunHello lists a worker's tasks (adapters), AdapterAdd / AdapterResult;
                              # 9: DraftHello lists the sessions it holds (held) and is stamped;
                              # 10: SUN requests carry a grammar and logprobs (SunRequest, PrefillJob,
                              #     DecodeAssign), SunTokens its tokens' logprobs, SunHello `grammars`
                              # 11: the reverse star: VerifyRequest / VerifyResponse, Join role "drafter",
                              #     error code context_full, the verify service's hello topic, telemetry roles
                              #     drafter and verify
                              # 12: VerifyRequest carries a grammar (grammar_id, grammar, grammar_from) and
                              #     logprobs, VerifyResponse its tokens' logprobs
                              # 13: Join names the sessions its client ended (ended), released before counting
                              # 14: a DecodeAssign sent again says its prefill worker is done (kv_sent)
MAX_MESSAGE_BYTES = 4 << 20

def wire(check: Callable[[str, Any], Any], default: Any = MISSING, factory: Any = MISSING,
         send: Optional[Callable[[Any], Any]] = None, kw_only: bool = False):
    """A message field: `check` validates its wire value; `send` turns the Python value into it.
    A default must pass `check`. `kw_only`: a field with no valid default declared after fields
    with one: required, and given by name (its place on the wire is unchanged)."""
    return field(default=default, default_factory=factory, kw_only=kw_only,
                 metadata={"check": check, "send": send})


_BY_TAG: dict[str, type] = {}


def sampling_field():
    """A SamplingParams dict field (greedy unless given)."""
    return wire(check_sampling, factory=sampling)


def tokens_field(limit: int, **kw):
    """A token-id list field of at most `limit` ids."""
    return wire(token_ids(limit), send=as_token_list, **kw)


class Message:
    """Base of every wire message; `@message(tag)` registers a subclass."""
    TAG: ClassVar[str] = ""
    SESSION: ClassVar[bool] = False       # signed with the session's (or request's) secret
    ID_FIELD: ClassVar[str] = "sid"       # the field the envelope's "s" must equal
    CHECKS: ClassVar[dict] = {}

    def check_rules(self) -> None:
        """Cross-field rules, after every field checked; raise ProtocolError."""

    def session_id(self) -> str:
        return getattr(self, self.ID_FIELD) if self.SESSION else ""


def message(tag: str, session: bool = False, id_field: str = "sid"):
    def register(cls):
        cls = dataclass(cls)
        cls.TAG, cls.SESSION, cls.ID_FIELD = tag, session, id_field
        cls.CHECKS = {f.name: f.metadata["check"] for f in fields(cls)}
        _BY_TAG[tag] = cls
        return cls
    return register


# ---- the envelope ----


def _validate(cls: type, body: Any) -> Message:
    tag, checks = cls.TAG, cls.CHECKS
    if not isinstance(body, dict) or set(body) != set(checks):
        # keys may mix str and bytes (sort by repr) and be many (cut short)
        got = _short(sorted(body, key=repr)) if isinstance(body, dict) else type(body).__name__
        raise ProtocolError(f"{tag} must have fields {sorted(checks)}, got {got}")
    msg = cls(**{k: check(f"{tag}.{k}", body[k]) for k, check in checks.items()})
    msg.check_rules()
    return msg


def _mac(secret: bytes, version: int, tag: str, sid: str, body: bytes) -> bytes:
    head = b"starsun\0" + struct.pack(">H", version) + tag.encode() + b"\0" + sid.encode() + b"\0"
    return hmac.new(secret, head + body, hashlib.sha256).digest()


def encode(msg: Message, secret: Optional[bytes] = None) -> bytes:
    """Validate and pack a message; session messages need the session secret."""
    if not isinstance(msg, Message) or not msg.TAG:
        raise TypeError(f"not a protocol message: {type(msg).__name__}")
    body = {}
    for f in fields(msg):
        v = getattr(msg, f.name)
        send = f.metadata["send"]
        body[f.name] = send(v) if send is not None else v
    _validate(type(msg), body)            # a bad message fails at the sender, with its reason
    if msg.SESSION and not secret:
        raise ProtocolError(f"{msg.TAG} is a session message: pass the session secret", "auth")
    raw = msgpack.packb(body, use_bin_type=True)
    sid = msg.session_id()
    mac = _mac(secret, PROTOCOL_VERSION, msg.TAG, sid, raw) if secret else b""
    out = msgpack.packb({"v": PROTOCOL_VERSION, "t": msg.TAG, "s": sid, "b": raw, "h": mac}, use_bin_type=True)
    if len(out) > MAX_MESSAGE_BYTES:
        raise ProtocolError(f"{msg.TAG} is {len(out)} bytes; at most {MAX_MESSAGE_BYTES}", "size")
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
    if cls.SESSION:
        check_id(sid, "session id")
    elif sid != "":
        raise ProtocolError(f"{tag} carries no session id", "format")
    key = secret(sid) if callable(secret) else secret
    if cls.SESSION and not key:
        raise ProtocolError(f"no secret for session {sid!r}: unknown or expired session", "auth")
    if key is not None and not hmac.compare_digest(mac, _mac(key, env["v"], tag, sid, raw)):
        raise ProtocolError(f"{tag} for session {sid!r} has a bad HMAC: dropped", "auth")
    msg = _validate(cls, _unpack(raw, tag))
    if cls.SESSION and msg.session_id() != sid:
        raise ProtocolError(f"{tag}: body id {msg.session_id()!r} differs from envelope sid {sid!r}")
    return msg
