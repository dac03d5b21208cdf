"""Where the hub's broker listens: loopback by default; beyond it only with authentication
and TLS, unless the user says --insecure.

Why: any client that reaches a broker without ACLs may subscribe to `ss/#` and read every
device's tokens (the HMAC protects integrity, not confidentiality), so exposing the hub on
a network must be a decision, not a default.
"""
from __future__ import annotations

from typing import Iterable, List, Optional

from server.broker_base import Listener, is_loopback

PLAIN_PORT, TLS_PORT = 1883, 8883


def parse_listen(spec: str, default_port: int) -> tuple[str, int]:
    """'ADDR', 'ADDR:PORT' or '[v6]:PORT' -> (addr, port)."""
    host, port = spec, default_port
    if spec.startswith("["):
        host, _, rest = spec[1:].partition("]")
        if rest.startswith(":"):
            port = rest[1:]
    elif spec.count(":") == 1:
        host, port = spec.split(":")
    try:
        port = int(port)
    except ValueError:
        raise ValueError(f"--listen {spec!r}: the port must be a number") from None
    if not host or not 0 < port < 65536:
        raise ValueError(f"--listen {spec!r}: write ADDR[:PORT] with a port in 1..65535")
    return host, port


def listeners_for(specs: Iterable[str], tls_dir: Optional[str], insecure: bool, acl: bool) -> List[Listener]:
    tls = None
    if tls_dir:
        from server.certs import CertError, broker_files
        try:
            tls = broker_files(tls_dir)
        except CertError as e:
            raise ValueError(f"--tls-dir: {e}") from None
    out = []
    for spec in specs:
        host, port = parse_listen(spec, TLS_PORT if tls else PLAIN_PORT)
        if not is_loopback(host) and not insecure:
            if not acl or tls is None:
                raise ValueError(
                    f"--listen {spec}: beyond loopback the hub needs authentication and TLS, or any "
                    f"client that reaches it could read every device's tokens. Add --acl and --tls-dir DIR "
                    f"(make DIR with `edge-hub certs --out DIR --host {host} --client-id CLIENT_ID ...`), "
                    f"or say --insecure on a network you trust")
        out.append(Listener(host, port, tls))
    return out
