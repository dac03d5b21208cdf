"""`SessionKeys`: the secret of every session a node serves, and raw MQTT payloads turned into
checked messages: a bad HMAC, a replayed (non-increasing) seq or an invalid body is dropped and
counted, never half-processed. Used by targets (edge/star/hub_client.py) and draft services."""
from __future__ import annotations

import logging
import threading
from typing import Dict, Optional

from edge.wire.protocol import ProtocolError, check_vocab, decode, encode, parse_topic
from edge.wire.replay_guard import ReplayGuard

log = logging.getLogger(__name__)


class SessionKeys:
    """sid -> (client, secret); checked decoding with drop counters."""

    def __init__(self) -> None:
        self._keys: Dict[str, tuple] = {}
        self._lock = threading.Lock()
        self.guard = ReplayGuard()
        self.dropped: Dict[str, int] = {}

    def add(self, sid: str, client: str, secret: bytes) -> None:
        with self._lock:
            self._keys[sid] = (client, secret)

    def remove(self, sid: str) -> None:
        with self._lock:
            self._keys.pop(sid, None)
        self.guard.forget(sid)

    def secret(self, sid: str) -> Optional[bytes]:
        with self._lock:
            e = self._keys.get(sid)
        return e[1] if e else None

    def client(self, sid: str) -> Optional[str]:
        with self._lock:
            e = self._keys.get(sid)
        return e[0] if e else None

    def __contains__(self, sid: str) -> bool:
        with self._lock:
            return sid in self._keys

    def drop(self, why: str) -> None:
        with self._lock:
            n = self.dropped[why] = self.dropped.get(why, 0) + 1
        # the first of each reason is worth a warning; a flood of them only a debug line each
        log.log(logging.WARNING if n == 1 else logging.DEBUG, "session message dropped (%s; %d so far)", why, n)

    def open(self, topic: str, payload: bytes, vocab_size: Optional[int] = None):
        """A checked session message from an up/down topic, or None (dropped and counted).

        Drop reasons: 'unknown_session', 'auth' (bad HMAC), 'replay', 'topic'
        (signed for another topic's session/client), 'invalid', 'format', ...
        """
        try:
            kind, ids = parse_topic(topic)
        except ProtocolError:
            self.drop("topic")
            return None
        sid = ids.get("sid")
        if sid is None or sid not in self:
            self.drop("unknown_session")
            return None
        try:
            msg = decode(payload, self.secret(sid))
            if vocab_size is not None:
                check_vocab(msg, vocab_size)
        except ProtocolError as e:
            self.drop(e.code)
            return None
        if msg.sid != sid or ids["client"] != self.client(sid):
            self.drop("topic")
            return None
        seq = getattr(msg, "seq", None)
        if seq is not None and not self.guard.accept(sid, seq):
            self.drop("replay")
            return None
        return msg

    def seal(self, msg) -> bytes:
        secret = self.secret(msg.sid)
        if secret is None:
            raise ProtocolError(f"no secret for session {msg.sid!r}", "auth")
        return encode(msg, secret)
