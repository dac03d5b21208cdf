"""A hub among several (docs/star.md "Several hubs"): its view of the others, heard on their
ss/hubs/{hub} announcements (edge/star/hub_ring.py's HubView), which are live, and which clients
this hub serves -- a device picks the owner of its client id by rendezvous hashing over the live
hubs, and a join naming no hub (an older device) or a SUN request is this hub's when it is their
owner in its own view.
"""
from __future__ import annotations

import logging
from typing import List

from edge.star.hub_ring import HubView, owner
from edge.wire.protocol import HubStatus, ProtocolError, decode, hub_hello_topic

log = logging.getLogger("server.hub")


class HubPeers:
    def __init__(self, hub_id: str, hubs, silent_after: float):
        """hubs: every hub's id, this one's included."""
        self.hub_id = hub_id
        self.view = HubView(hubs, silent_after)
        if hub_id not in self.view.hubs:
            raise ValueError(f"hub id {hub_id!r} is not in the hub list {self.view.hubs}: give every hub's id, "
                             "this one's included, in the same list on every hub and device")

    def others(self) -> List[str]:
        return [h for h in self.view.hubs if h != self.hub_id]

    def on_status(self, topic: str, payload: bytes, self_live: bool) -> None:
        """Another hub's announcement (or its will) on its ss/hubs/{hub}."""
        if not payload:
            return
        try:
            st = decode(payload)
        except ProtocolError:
            return
        if isinstance(st, HubStatus) and topic == hub_hello_topic(st.hub) and st.hub != self.hub_id:
            if self.view.heard(st.hub, st.online, st.time):
                log.info("hub %s: hub %s is %s; live hubs: %s", self.hub_id, st.hub,
                         "up" if st.online else "gone", self.live(self_live))

    def live(self, self_live: bool) -> List[str]:
        """The hubs this one counts as live, itself included while it runs (self_live)."""
        live = set(self.view.live()) | ({self.hub_id} if self_live else set())
        return [h for h in self.view.hubs if h in live]

    def owns(self, client: str, self_live: bool, settled: bool) -> bool:
        """Whether this hub serves `client` in its own view of the live hubs. Until it is `settled`
        (announced for two status periods) it claims none: the others let go of a client when they
        hear it, so a client is briefly nobody's (its retry finds the owner), never two hubs' (a
        SUN request routed twice)."""
        live = self.live(self_live)
        if not settled:
            live = [h for h in live if h != self.hub_id]
        return owner(client, live) == self.hub_id

    def sweep(self, self_live: bool) -> None:
        """Count the silent hubs as gone."""
        for gone in self.view.sweep():
            log.info("hub %s: hub %s is silent; live hubs: %s", self.hub_id, gone, self.live(self_live))

    def snapshot(self, self_live: bool) -> dict:
        return {**self.view.snapshot(), "live": self.live(self_live)}
