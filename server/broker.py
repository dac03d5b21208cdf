"""MQTT brokers for the hub and the tests: embedded amqtt (here), or a Mosquitto process
(server/mosquitto.py); `start_broker` picks one.

Both isolate sessions with the same access table (server/acl.py) when
`acl=True`: Mosquitto gets it as an ACL file (patterns with %u) plus a
password file; amqtt gets it as in-process plugins. Both serve TLS listeners the same
way: a client certificate of the star's CA is required, and its CN is the client's
username (Mosquitto's use_identity_as_username; here server/amqtt_tls.py).
"""
from __future__ import annotations

import asyncio
import os
import shutil
import threading
from dataclasses import dataclass
from typing import Any, Optional

from amqtt.broker import Broker
from amqtt.contexts import Action
from amqtt.plugins.base import BaseAuthPlugin, BaseTopicPlugin

from server.acl import Acl
from server.amqtt_tls import listener_config, require_client_cert, session_identity
from server.broker_base import (BrokerError, Listener, _BrokerBase, _check_port_free,  # noqa: F401
                                find_free_port, is_loopback)
from server.mosquitto import MosquittoBroker  # noqa: F401


class AclAuthPlugin(BaseAuthPlugin):
    """amqtt: username/password from the shared Acl."""

    @dataclass
    class Config:
        acl: Any = None

    async def authenticate(self, *, session) -> bool:
        cn = getattr(session, "tls_cn", None)    # set per connection by _TrackedBroker
        if cn is not None:                         # TLS: the verified certificate is the proof
            return bool(cn) and cn in self.config.acl.users
        return self.config.acl.check_password(session.username, session.password)


class AclTopicPlugin(BaseTopicPlugin):
    """amqtt: publish / subscribe / receive checks from the shared Acl."""

    @dataclass
    class Config:
        acl: Any = None

    async def topic_filtering(self, *, session=None, topic=None, action=None) -> bool:
        name = session.username if session else None
        what = {Action.PUBLISH: "write", Action.SUBSCRIBE: "subscribe", Action.RECEIVE: "read"}[action]
        return bool(topic) and self.config.acl.allows(name, topic, what)


class _SnapshotDict(dict):
    """A dict whose iteration walks a copy. amqtt 0.12.1 iterates its subscription
    table with awaits inside the loop (a new client's connect replays retained
    messages per filter; a broadcast checks each subscriber's ACL), so another
    client's SUBSCRIBE in between raised "dictionary changed size during
    iteration" and left the connecting client half-connected (no SUBACKs)."""

    def __iter__(self):
        return iter(list(super().keys()))

    def items(self):
        return list(super().items())

    def keys(self):
        return list(super().keys())

    def values(self):
        return list(super().values())


class _TrackedBroker(Broker):
    """amqtt's Broker, remembering client connections so stop() can cut them
    (amqtt 0.12.1's shutdown() can hang on a session with QoS 1 traffic), with
    its subscription table iterated over copies (_SnapshotDict)."""

    def __init__(self, *a, **kw) -> None:
        super().__init__(*a, **kw)
        self.writers: set = set()
        self._subscriptions = _SnapshotDict(self._subscriptions)

    async def _publish_retained_messages_for_subscription(self, subscription, session) -> None:
        # amqtt calls this on every connect for EVERY client's filters, which would
        # hand a newcomer retained messages it never subscribed to (past the ACL);
        # only the session's own subscriptions get their retained messages
        subs = self._subscriptions.get(subscription[0], ())
        if any(s.client_id == session.client_id for s, _ in subs):
            await super()._publish_retained_messages_for_subscription(subscription, session)

    # amqtt 0.12.1 makes TLS listeners with verify_mode CERT_OPTIONAL and never looks at
    # the certificate: require one (signed by the listener's CA) ...
    @staticmethod
    def _create_ssl_context(listener):
        return require_client_cert(Broker._create_ssl_context(listener))

    # ... and make its CN the session's username, as Mosquitto does (set on every connection:
    # amqtt reuses a non-clean session's object, which must not keep an earlier one's identity)
    async def _handle_client_session(self, reader, writer, client_session, handler, server, listener_name) -> None:
        tls = bool(self.listeners_config[listener_name].get("ssl", False))
        session_identity(client_session, writer, tls)
        await super()._handle_client_session(reader, writer, client_session, handler, server, listener_name)

    async def stream_connected(self, reader, writer, listener_name: str) -> None:
        self.writers.add(writer)
        try:
            await super().stream_connected(reader, writer, listener_name)
        finally:
            self.writers.discard(writer)

    async def halt(self, timeout: float = 2.0) -> None:
        for w in list(self.writers):             # clients see the broker die at once
            w.transport.abort()
        try:
            await asyncio.wait_for(self.shutdown(), timeout)
        except Exception:
            pass                                  # stopping anyway; listeners closed below
        for server in list(getattr(self, "_servers", {}).values()):
            try:
                await asyncio.wait_for(server.close_instance(), timeout)
            except Exception:
                pass
        me = asyncio.current_task()
        rest = [t for t in asyncio.all_tasks() if t is not me]
        for t in rest:
            t.cancel()
        await asyncio.wait(rest, timeout=timeout) if rest else None


class EmbeddedBroker(_BrokerBase):
    """amqtt 0.12.1 (pure Python, MQTT 3.1.1) on its own thread and event loop."""

    def __init__(self, port: Optional[int] = None, host: str = "127.0.0.1", acl: bool = False,
                 hub_user: str = "hub", listeners=()) -> None:
        self.host, self.port = host, port or find_free_port(host)
        self.listeners = list(listeners)          # plain TCP, or TLS (Listener.tls)
        self.acl = Acl() if acl else None
        self.hub_user = hub_user
        self.hub_password = self.acl.add(hub_user, "hub") if self.acl else ""
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._thread: Optional[threading.Thread] = None
        self._broker: Optional[_TrackedBroker] = None

    def _config(self) -> dict:
        plugins: dict[str, Any] = {}
        if self.acl:
            plugins["server.broker.AclAuthPlugin"] = {"acl": self.acl}
            plugins["server.broker.AclTopicPlugin"] = {"acl": self.acl}
        else:
            plugins["amqtt.plugins.authentication.AnonymousAuthPlugin"] = {"allow_anonymous": True}
        listen = {"default": {"type": "tcp", "bind": f"{self.host}:{self.port}"}}
        for i, ln in enumerate(self.listeners):
            listen[f"extra{i}"] = listener_config(ln)
        return {"listeners": listen, "plugins": plugins}

    def start(self, timeout: float = 10.0) -> "EmbeddedBroker":
        if self._thread:
            return self
        for host, port in [(self.host, self.port)] + [(ln.host, ln.port) for ln in self.listeners]:
            _check_port_free(host, port)
        ready, failure = threading.Event(), []

        def run() -> None:
            loop = asyncio.new_event_loop()
            asyncio.set_event_loop(loop)
            self._loop = loop

            async def boot() -> None:
                self._broker = _TrackedBroker(self._config(), loop=loop)
                await self._broker.start()
            try:
                loop.run_until_complete(boot())
            except Exception as exc:  # amqtt wraps bind errors etc. in BrokerError
                failure.append(exc)
                ready.set()
                loop.close()
                return
            ready.set()
            loop.run_forever()
            loop.close()

        self._thread = threading.Thread(target=run, name=f"amqtt-{self.port}", daemon=True)
        self._thread.start()
        if not ready.wait(timeout) or failure:
            self._thread = None
            raise BrokerError(f"the embedded MQTT broker could not listen on {self.host}:{self.port}: "
                              f"{failure[0] if failure else 'timed out'}; pick another --port")
        return self

    def stop(self) -> None:
        if not self._thread or not self._loop:
            return
        try:
            asyncio.run_coroutine_threadsafe(self._broker.halt(), self._loop).result(10)
        except Exception:
            pass                                  # stopping anyway
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._thread = None


def start_broker(kind: str = "auto", port: Optional[int] = None, acl: bool = False, listeners=()):
    """kind: 'mosquitto', 'embedded' or 'auto' (Mosquitto when installed); `listeners`: more
    addresses (Listener) beyond the loopback one the hub itself uses."""
    if kind == "auto":
        kind = "mosquitto" if shutil.which("mosquitto") or os.path.exists("/usr/sbin/mosquitto") else "embedded"
    if kind not in ("mosquitto", "embedded"):
        raise BrokerError(f"broker kind must be mosquitto, embedded or auto, got {kind!r}")
    if kind == "mosquitto":
        return MosquittoBroker(port=port, acl=acl, listeners=listeners).start()
    return EmbeddedBroker(port=port, acl=acl, listeners=listeners).start()
