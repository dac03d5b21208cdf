"""A site broker bridged to the hub's broker: the edge-site topology of a star (issue 38).

Devices at a site attach to their site's Mosquitto; it forwards the star's topics (`ss/#`, both
ways, QoS up to 1) over one bridge connection to the hub's broker. `SiteBroker` is a
server/mosquitto.py MosquittoBroker with that bridge in its configuration; `bridged()` waits
until a message crosses both ways.
"""
from __future__ import annotations

import time

from edge.wire.link import MqttLink
from server.mosquitto import MosquittoBroker


class SiteBroker(MosquittoBroker):
    def __init__(self, hub: MosquittoBroker, **kw) -> None:
        super().__init__(**kw)
        self.hub = hub

    def _write_files(self) -> None:
        super()._write_files()
        bridge = ["connection site-to-hub", f"address {self.hub.host}:{self.hub.port}",
                  "topic ss/# both 1", "cleansession true", "bridge_protocol_version mqttv311",
                  "try_private true", "notifications false", "restart_timeout 1", "keepalive_interval 5"]
        conf = self.dir / "mosquitto.conf"
        conf.write_text(conf.read_text() + "\n".join(bridge) + "\n")

    def bridged(self, timeout: float = 15.0) -> bool:
        """True once a message published at the site reaches the hub and one from the hub the site."""
        site, hub = MqttLink(self.url).connect(5), MqttLink(self.hub.url).connect(5)
        got = set()
        try:
            site.subscribe("ss/bridge-check/down", lambda t, p: got.add("down"))
            hub.subscribe("ss/bridge-check/up", lambda t, p: got.add("up"))
            end = time.monotonic() + timeout
            while time.monotonic() < end and got != {"up", "down"}:
                site.publish("ss/bridge-check/up", b"?")
                hub.publish("ss/bridge-check/down", b"?")
                time.sleep(0.2)
            return got == {"up", "down"}
        finally:
            site.close()
            hub.close()
