"""TLS listeners of the embedded amqtt broker, made to act as Mosquitto's
(server/mosquitto.py: `require_certificate true`, `use_identity_as_username true`):

- the client must present a certificate signed by the star's CA (amqtt 0.12.1 itself
  asks with CERT_OPTIONAL, so a client without one would get in: `require_client_cert`);
- the certificate's CN is the client's username, whatever CONNECT says, and no password is
  asked: the certificate is the proof (`session_identity`; server/broker.py's AclAuthPlugin
  admits it when the CN is a user of the ACL, so a CN that no --user names is refused --
  Mosquitto would let it in with the client patterns).
"""
from __future__ import annotations

import ssl
from typing import Optional

from server.broker_base import Listener


def listener_config(ln: Listener) -> dict:
    """amqtt's listener dict for a server.broker_base.Listener (plain TCP or TLS)."""
    conf = {"type": "tcp", "bind": f"{ln.host}:{ln.port}"}
    if ln.tls is not None:
        conf.update(ssl=True, cafile=str(ln.tls.ca), certfile=str(ln.tls.cert), keyfile=str(ln.tls.key))
    return conf


def require_client_cert(ctx: ssl.SSLContext) -> ssl.SSLContext:
    """amqtt's context (CA loaded, broker cert and key) with a client certificate required."""
    ctx.verify_mode = ssl.CERT_REQUIRED           # no certificate, or another CA's: handshake fails
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2  # as Mosquitto's tls_version tlsv1.2
    return ctx


def peer_cn(writer) -> Optional[str]:
    """CN of the verified client certificate of an amqtt StreamWriterAdapter ('' if it has none)."""
    sslobj = writer.get_ssl_info() if hasattr(writer, "get_ssl_info") else None
    cert = sslobj.getpeercert() if sslobj is not None else None
    if not cert:
        return ""
    for rdn in cert.get("subject", ()):
        for key, value in rdn:
            if key == "commonName":
                return value
    return ""


def session_identity(session, writer, tls: bool) -> None:
    """Per connection: on a TLS listener the session's username is its certificate's CN
    (`tls_cn`, '' when it has none: refused); on a plain one `tls_cn` is None (password)."""
    if not tls:
        session.tls_cn = None
        return
    cn = peer_cn(writer)
    session.tls_cn = cn
    session.username, session.password = cn or None, None
