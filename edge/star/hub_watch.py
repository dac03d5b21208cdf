"""A device's watch over several hubs: their announcements, their silence, and its owner.

With a hub list (`--hub-ids a,b`) a device reads each hub's announcement on its own topic
ss/hubs/{hub} (exact topics: their retained copy arrives even where wildcards get none) into a
HubView (edge/star/hub_ring.py), sweeps it for silent hubs every `tick_s`, and calls
`on_change(hub)` whenever a hub went offline, came up or restarted: the sessions that hub
assigned are then gone (HubClient marks them lost; their drafters rejoin on the new owner,
decoding alone meanwhile).
"""
from __future__ import annotations

import logging
import threading
from typing import Callable, Iterable, Optional

from edge.star.hub_ring import HUB_SILENT_S, HubView
from edge.wire.link import Link
from edge.wire.protocol import HubStatus, ProtocolError, decode, hub_hello_topic

log = logging.getLogger(__name__)
TICK_S = 0.25           # how often silence is checked (a will needs no check: it arrives)


class HubWatch:
    def __init__(self, link: Link, hubs: Iterable[str], on_change: Callable[[str], None],
                 silent_after: float = HUB_SILENT_S, tick_s: float = TICK_S):
        self.link, self.on_change, self.tick_s = link, on_change, tick_s
        self.heard = 0                              # announcements heard, from any hub
        self.view = HubView(hubs, silent_after)
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def start(self) -> "HubWatch":
        for hub in self.view.hubs:
            self.link.subscribe(hub_hello_topic(hub), self._on_announcement)
        self._thread = threading.Thread(target=self._sweep_loop, name="hub-watch", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def owner(self, client: str) -> Optional[str]:
        return self.view.owner(client)

    def epoch(self, hub: str) -> Optional[float]:
        return self.view.epoch(hub) if hub in self.view.hubs else None

    def any_live(self) -> bool:
        return bool(self.view.live())

    def _on_announcement(self, topic: str, payload: bytes) -> None:
        if not payload:
            return
        try:
            st = decode(payload)
        except ProtocolError as e:
            log.debug("hub announcement on %s dropped: %s", topic, e)
            return
        if not isinstance(st, HubStatus) or topic != hub_hello_topic(st.hub):
            return                                  # a hub speaks only on its own topic
        self.heard += 1
        if self.view.heard(st.hub, st.online, st.time, bool(st.services)):
            log.info("hub %s is %s; live hubs: %s", st.hub, "up" if st.online else "gone", self.view.live())
            self.on_change(st.hub)

    def _sweep_loop(self) -> None:
        while not self._stop.wait(self.tick_s):
            for hub in self.view.sweep():
                log.info("hub %s is silent; live hubs: %s", hub, self.view.live())
                try:
                    self.on_change(hub)
                except Exception:
                    log.exception("hub change handling failed")
