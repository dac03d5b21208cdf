"""A hub that is a client of an external broker over TLS (`edge-hub serve --broker mqtts://A,mqtts://B
--tls-dir DIR`): every connection it opens -- its own, its draft service's, its SUN decoder's -- carries
the hub's client certificate and the whole broker list, so each fails over to the next node alone.

server/hub.py builds plain links for a broker it starts or an mqtt:// one; this keeps TLS out of it.
"""
from __future__ import annotations

import time

from edge.wire.link import MqttLink
from server.hub import Hub


class ExternalTlsHub(Hub):
    """Hub(broker_url=mqtts://..., tls=(CA, certificate, key), ...)."""

    def __init__(self, *, tls: tuple, **kw) -> None:
        super().__init__(**kw)
        self.tls = tls

    def start(self) -> "ExternalTlsHub":
        if self.link is None:
            self.link = self._tls_link(self.hub_id)
        return super().start()

    def _second_link(self, name: str):
        return self._tls_link(name)

    def _tls_link(self, name: str) -> MqttLink:
        # the broker takes the certificate's CN as the username; the client id only has to be unique
        return MqttLink(self.broker_url, client_id=f"{name}-{int(time.time() * 1000) % 10**9}",
                        username=self.username, password=self.password, tls=self.tls, keepalive=self.keepalive)
