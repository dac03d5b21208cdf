"""Has the provisioned agent joined the star? Read what the hub's broker shows (edge/wire/topics.py):

  hub      ss/hub/status (retained HubStatus): the hub is online; its `services` lists the
           draft services the hub has registered
  draft    ss/hub/drafts/{id} (retained DraftHello, online) and the hub's status listing it
  prefill  ss/sun/workers/{id} (retained SunHello, online): the SUN router routes to it
  decoder  the same topic
  target   ss/c/{id}/joined: the hub's Joined answer to the target's Join (not retained, so
           the watch subscribes before the agent is (re)started); a refusal (no draft
           service yet) still means the target reached the hub: it decodes alone and rejoins
"""
from __future__ import annotations

import threading
import time
from typing import Optional

from edge.wire.link import MqttLink
from edge.wire.protocol import STATUS_TOPIC, ProtocolError, decode
from edge.wire.topics import draft_hello_topic, joined_topic, sun_hello_topic


class JoinWatch:
    def __init__(self, hub_url: str, role: str, client_id: str, username: Optional[str] = None,
                 password: Optional[str] = None, tls=None):
        self.role, self.client_id = role, client_id
        self.link = MqttLink(hub_url, client_id=f"provision-{client_id}-{int(time.time()) % 100000}",
                             username=username, password=password, tls=tls)
        self.topic = {"target": joined_topic, "draft": draft_hello_topic}.get(role, sun_hello_topic)(client_id)
        self.hub_online = False
        self.hub_services: list = []
        self.own: Optional[object] = None      # the last message about our agent
        self._cv = threading.Condition()

    def _on(self, topic: str, payload: bytes) -> None:
        if not payload:
            return                              # a cleared retained message
        try:
            msg = decode(payload)
        except ProtocolError:
            return
        with self._cv:
            if topic == STATUS_TOPIC:
                self.hub_online, self.hub_services = bool(msg.online), list(msg.services)
            else:
                self.own = msg
            self._cv.notify_all()

    def start(self, timeout: float = 10.0) -> "JoinWatch":
        """Subscribe and take in what is retained now (the hub's status comes with it when a hub runs)."""
        self.link.subscribe(STATUS_TOPIC, self._on)
        self.link.subscribe(self.topic, self._on)
        self.link.connect(timeout=timeout)
        with self._cv:
            self._cv.wait_for(lambda: self.hub_online, timeout=2.0)
        return self

    def forget(self) -> None:
        """Drop what was heard about the agent: after a restart only its new hello counts (the
        retained one may be the old process's)."""
        with self._cv:
            self.own = None

    def close(self) -> None:
        self.link.close()

    def _joined(self) -> Optional[str]:
        m, cid = self.own, self.client_id
        if m is None or not self.hub_online:
            return None
        if self.role == "target":
            if m.accepted:
                return f"target {cid} joined the star: session {m.sid} drafted by {m.draft}"
            return (f"target {cid} reached the hub, which refused a session ({m.reason}): it decodes alone "
                    "and joins when the hub can draft")
        if not m.online:
            return None
        if self.role == "draft":
            return f"draft service {cid} registered at the hub" if cid in self.hub_services else None
        what = f"prefill worker for task {m.task!r}" if m.role == "prefill" else "shared decoder"
        return f"{what} {cid} announced itself to the hub's SUN router (capacity {m.capacity})"

    def wait(self, timeout: float) -> str:
        """The line that says the agent has joined; TimeoutError saying what was seen otherwise."""
        end = time.monotonic() + timeout
        with self._cv:
            while True:
                done = self._joined()
                if done:
                    return done
                left = end - time.monotonic()
                if left <= 0:
                    break
                self._cv.wait(min(left, 1.0))
            if not self.hub_online:
                raise TimeoutError(f"no hub is online at {self.link.url} (no retained ss/hub/status with "
                                   "online=true): start it (`edge-hub serve`) and check HUB=")
            seen = ("nothing from it" if self.own is None else
                    f"it is offline ({type(self.own).__name__} online=false)" if not getattr(self.own, "online", True)
                    else "its hello, but the hub has not listed it yet")
            raise TimeoutError(f"the hub is online but {self.role} {self.client_id} has not joined in "
                               f"{timeout:.0f} s ({seen} on {self.topic}): look at the agent's log on the device "
                               "(journalctl [--user] -u starsun-agent)")
