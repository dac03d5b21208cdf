"""Why a TLS connection to a broker failed, caught where paho meets it, so that MqttLink.connect
ends at once with what failed and what to do instead of waiting out its timeout.

paho retries a failed connection in its own loop, and its on_connect_fail says no more than that
it failed. A TLS failure shows in one of three places:

* the handshake (paho's reconnect() raises ssl.SSLError): our CA does not verify the broker's
  certificate, or, in TLS 1.2, the broker's alert refusing our client certificate;
* the first read after the handshake (ssl.SSLError from recv): in TLS 1.3 a client's handshake is
  over before the broker checks its certificate, so Mosquitto's refusal is an alert read here
  (certificate required, unknown CA, decrypt error);
* an end of stream before the broker's CONNACK: Python's TLS servers (the embedded amqtt broker)
  refuse a TLS 1.3 client certificate by closing the connection without an alert. A broker that
  read our CONNECT answers it (CONNACK, a refusal included), so a TLS connection it closes first
  is one it would not take.

A failure counts only while a CONNACK is awaited; a later connection loss is not one. A plain
(mqtt://) connection closed before its CONNACK is only noted (`dropped_unanswered`: a TLS port read
as MQTT does that, and so may a busy or starting broker, which a retry reaches): the timeout's
error says so.
"""
from __future__ import annotations

import logging
import ssl
from typing import Optional, Sequence

log = logging.getLogger(__name__)

# OpenSSL's reasons for alerts a broker sends when it will not take our client certificate
_CERT_REFUSED = ("ALERT_CERTIFICATE_REQUIRED", "ALERT_HANDSHAKE_FAILURE", "ALERT_UNKNOWN_CA", "ALERT_BAD_CERTIFICATE",
                 "ALERT_DECRYPT_ERROR", "ALERT_CERTIFICATE_UNKNOWN", "ALERT_ACCESS_DENIED", "ALERT_UNSUPPORTED_CERTIFICATE",
                 "ALERT_CERTIFICATE_EXPIRED", "ALERT_CERTIFICATE_REVOKED", "UNEXPECTED_EOF")


class TlsFailures:
    """A mixin for paho's Client: `tls_failure` holds the first TLS failure of the connection
    attempt under way (None: none), found where paho would only retry. Set `watch_tls` for an
    mqtts:// link; call answered() when a CONNACK came."""

    watch_tls = False
    tls_failure: Optional[str] = None        # "<kind>: <reason>", kind one of verify / refused / handshake
    dropped_unanswered = False               # a broker closed a connection before its CONNACK (any URL)
    _awaiting_connack = False

    def answered(self) -> None:
        self._awaiting_connack = self.dropped_unanswered = False
        self.tls_failure = None

    def reconnect(self):
        self._awaiting_connack = True
        try:
            return super().reconnect()
        except ssl.SSLError as e:
            self._failed(e)
            raise

    def _sock_recv(self, bufsize: int) -> bytes:
        try:
            data = super()._sock_recv(bufsize)
        except ssl.SSLError as e:
            self._failed(e)
            raise
        except ConnectionError:
            self.dropped_unanswered = self.dropped_unanswered or self._awaiting_connack
            raise
        if not data:
            self.dropped_unanswered = self.dropped_unanswered or self._awaiting_connack
            self._failed(None)
        return data

    def _failed(self, error: Optional[ssl.SSLError]) -> None:
        if not (self.watch_tls and self._awaiting_connack) or self.tls_failure is not None:
            return
        if error is None:
            self.tls_failure = "refused: the broker closed the TLS connection before answering our CONNECT"
        elif isinstance(error, ssl.SSLCertVerificationError):
            self.tls_failure = f"verify: {error.verify_message or error}"
        else:
            reason = getattr(error, "reason", None) or str(error)
            kind = "refused" if any(r in reason for r in _CERT_REFUSED) else "handshake"
            self.tls_failure = f"{kind}: {reason}"
        log.warning("TLS connection to %s:%s failed: %s", getattr(self, "host", "?"), getattr(self, "port", "?"),
                    self.tls_failure)


def tls_failure_message(url: str, failure: str, tls: Optional[Sequence[Optional[str]]]) -> str:
    """What LinkError says for a TlsFailures.tls_failure: what failed, what to do."""
    kind, _, reason = failure.partition(": ")
    ca, cert, _key = (list(tls) + [None, None, None])[:3] if tls else (None, None, None)
    if kind == "verify":
        return (f"the broker at {url} is not the one our CA names: its TLS certificate did not verify ({reason}) "
                f"against {ca or 'the system CAs'}; pass the star's ca.crt (`edge-hub certs` wrote it: --tls-dir) "
                "and a --broker host its certificate was made for (`edge-hub certs --host`)")
    if kind == "refused":
        ours = f"the certificate {cert}" if cert else "no client certificate"
        return (f"broker {url} did not accept our TLS client certificate ({reason}; we gave {ours}): it admits "
                "only one signed by its own CA -- pass --tls-dir with this device's files from "
                "`edge-hub certs --client-id NAME` (ca.crt, clients/NAME.crt and .key)")
    return (f"the TLS handshake with {url} failed ({reason}): check that the port is the hub's TLS "
            "listener (plain MQTT is mqtt://) and that --tls-dir holds this device's certificate from the "
            "star's CA (`edge-hub certs --client-id NAME`)")
