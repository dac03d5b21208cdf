"""Where a link connects: broker URLs, a star's list of broker nodes, and paho's client moving
round that list (edge/wire/link.py's MqttLink uses them; docs/star.md says why the order)."""
from __future__ import annotations

from typing import Optional
from urllib.parse import unquote, urlsplit

import paho.mqtt.client as mqtt

from edge.wire.tls_failure import TlsFailures

DEFAULT_PORT = 1883
DEFAULT_TLS_PORT = 8883


class LinkError(RuntimeError):
    """The broker cannot be reached or refused us; the message says what to do."""


def parse_url(url: str) -> tuple[str, int, Optional[str], Optional[str]]:
    """mqtt[s]://[user[:password]@]host[:port] -> (host, port, user, password)."""
    parts = urlsplit(url)
    if parts.scheme not in ("mqtt", "mqtts"):
        raise LinkError(f"broker URL {url!r} must look like mqtt://host:port or mqtts://host:port "
                        f"(scheme {parts.scheme or 'missing'!r} is not supported)")
    if not parts.hostname:
        raise LinkError(f"broker URL {url!r} has no host")
    try:
        port = parts.port or (DEFAULT_TLS_PORT if parts.scheme == "mqtts" else DEFAULT_PORT)
    except ValueError:
        raise LinkError(f"broker URL {url!r} has a bad port") from None
    user = unquote(parts.username) if parts.username else None
    pw = unquote(parts.password) if parts.password else None
    return parts.hostname, port, user, pw


def parse_urls(spec) -> list[str]:
    """A broker list -- "mqtts://a:8883,mqtts://b:8883" or a list of URLs -- checked, in order.

    One star may sit on several nodes of a clustered broker: a link tries them in this order
    and moves to the next when its broker is lost (`BrokerList`)."""
    items = spec.split(",") if isinstance(spec, str) else list(spec)
    urls = [u.strip() for u in items if u and u.strip()]
    if not urls:
        raise LinkError(f"no broker URL in {spec!r}: give mqtt[s]://HOST:PORT, or several separated by commas")
    for u in urls:
        parse_url(u)
    if len({urlsplit(u).scheme for u in urls}) > 1:
        raise LinkError(f"broker list {spec!r} mixes mqtt:// and mqtts://: every node of one star "
                        "speaks the same (TLS or not)")
    return urls


class BrokerList:
    """Which broker a link tries next: the first at start, then round the list, one step per
    lost connection or failed attempt (paho itself retries one host only)."""

    def __init__(self, spec) -> None:
        self.urls = parse_urls(spec)
        self.addresses = [parse_url(u)[:2] for u in self.urls]
        self.index = 0
        self.failovers = 0                 # moves to another broker

    @property
    def current(self) -> str:
        return self.urls[self.index]

    def advance(self) -> tuple[str, int]:
        """The next broker's (host, port); with one broker, that one again."""
        if len(self.urls) > 1:
            self.index = (self.index + 1) % len(self.urls)
            self.failovers += 1
        return self.addresses[self.index]


STABLE_S = 2.0     # a connection that lasted this long proved its broker up (see FailoverClient)


class FailoverClient(TlsFailures, mqtt.Client):
    """paho's client, but each reconnect after a loss or a failed attempt goes to the next broker
    of the list (paho's own reconnect loop calls reconnect(); host and port are its own fields).

    Except once: a broker that itself closed a connection held STABLE_S is up, so it is tried
    first. RabbitMQ 3.10 drops live nodes' MQTT connections when another node goes (a QoS 1
    publish routed there is nacked; its MQTT plugin crashes on the nack): moving on could wait
    out a connect to the lost node (3.4 s measured, docs/star.md). A killed broker refuses the
    retry at once; keepalive leaves a hung or cut-off one, and that loss moves on. A TLS failure is
    kept for MqttLink.connect to tell (edge/wire/tls_failure.py)."""

    def __init__(self, brokers: BrokerList, *args, **kw) -> None:
        super().__init__(*args, **kw)
        self.brokers = brokers
        self.base_id = kw["client_id"]
        self.tried = False                 # a first attempt went out; later ones move on
        self.same_next = False             # the broker closed a stable connection: try it once more

    def reconnect(self):
        same, self.same_next = self.same_next, False
        if self.tried and len(self.brokers.urls) > 1 and not same:
            self._host, self._port = self.brokers.advance()
            # a fresh client id on another node: RabbitMQ would first delete the old id's queue,
            # which lives on the dead node, and close the connection ("home node not running")
            self._client_id = f"{self.base_id}-f{self.brokers.failovers}".encode()
        self.tried = True
        return super().reconnect()
