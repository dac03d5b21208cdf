"""TLS failures a link meets where paho only retries (edge/wire/tls_failure.py): which count, and
what the error tells the user. With real brokers: tests/system/test_hub_tls.py."""
from __future__ import annotations

import ssl

import pytest

from edge.wire.tls_failure import TlsFailures, tls_failure_message

ALERT = "TLSV13_ALERT_CERTIFICATE_REQUIRED"


class _Client:
    """What paho's Client gives the mixin: a reconnect and a socket read, failing as told."""

    def __init__(self):
        self.connect_error = None
        self.read = b"\x20"                   # the first byte of a CONNACK

    def reconnect(self):
        if self.connect_error:
            raise self.connect_error

    def _sock_recv(self, bufsize):
        if isinstance(self.read, BaseException):
            raise self.read
        return self.read


class Watched(TlsFailures, _Client):
    pass


def _ssl_error(reason: str) -> ssl.SSLError:
    e = ssl.SSLError(1, f"[SSL: {reason}] alert")
    e.reason = reason
    return e


def _attempt(client, read=None, connect_error=None):
    client.connect_error, client.read = connect_error, read if read is not None else b"\x20"
    try:
        client.reconnect()
        client._sock_recv(1)
    except OSError:
        pass
    return client.tls_failure


def test_an_alert_after_the_handshake_is_a_refused_certificate():
    c = Watched()
    c.watch_tls = True
    assert _attempt(c, read=_ssl_error(ALERT)) == f"refused: {ALERT}"


def test_a_broker_closing_tls_before_its_connack_refused_it_and_a_plain_one_is_only_noted():
    c = Watched()
    c.watch_tls = True
    assert _attempt(c, read=b"").startswith("refused: the broker closed the TLS connection")
    plain = Watched()
    assert _attempt(plain, read=b"") is None and plain.dropped_unanswered
    plain.answered()
    assert _attempt(plain, read=ConnectionResetError()) is None and plain.dropped_unanswered


def test_handshake_failures_are_told_apart():
    c = Watched()
    c.watch_tls = True
    bad = ssl.SSLCertVerificationError(1, "certificate verify failed")
    bad.verify_message = "certificate signature failure"
    assert _attempt(c, connect_error=bad) == "verify: certificate signature failure"
    c.answered()
    assert _attempt(c, connect_error=_ssl_error("WRONG_VERSION_NUMBER")) == "handshake: WRONG_VERSION_NUMBER"


def test_only_while_a_connack_is_awaited():
    c = Watched()
    c.watch_tls = True
    assert _attempt(c) is None               # a CONNACK's byte came
    c.answered()                             # connected: a later loss is no TLS failure
    assert c._sock_recv(1) == b"\x20"
    c.read = b""
    c._sock_recv(1)
    assert c.tls_failure is None and not c.dropped_unanswered


@pytest.mark.parametrize("failure, says", [
    (f"refused: {ALERT}", ["did not accept our TLS client certificate", ALERT, "no client certificate",
                           "edge-hub certs --client-id"]),
    ("verify: certificate signature failure", ["did not verify", "ca.pem", "ca.crt"]),
    ("handshake: WRONG_VERSION_NUMBER", ["WRONG_VERSION_NUMBER", "mqtt://"]),
])
def test_the_error_says_what_failed_and_what_to_do(failure, says):
    msg = tls_failure_message("mqtts://hub:8883", failure, ("ca.pem", None, None))
    for s in says:
        assert s in msg, msg
