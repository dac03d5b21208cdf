"""A small pub/sub link: MQTT (paho-mqtt 2.x) for real, an in-memory bus for tests.

Both implementations share the `Link` interface and semantics: MQTT topic
filters with `+` and `#`, retained messages, a last will, callbacks run on the
link's own delivery thread (one per link, in arrival order — keep them short:
hand work to a queue), and automatic re-subscription after a reconnect.
subscribe() returns on the broker's SUBACK; `wait_subscribed()` waits for every filter, those
re-subscribed after a reconnect included (edge/wire/subacks.py). The in-memory bus: memory_link.py.

Give each link non-overlapping filters: MQTT 3.1.1 lets a broker send one
copy per matching subscription (amqtt does, Mosquitto does not), and every
copy reaches every matching callback. Mosquitto 2 disconnects a 3.1.1 client
that publishes where its ACL denies it; the link then reconnects by itself.

QoS is chosen by message kind (`KINDS`): draft traffic is QoS 0 — a lost
request only costs one speculation round (the target decodes alone past its
deadline) and QoS 1 would add a PUBACK per message; control messages (join,
joined, bye, assignments) are QoS 1; status is QoS 1 and retained.
"""
from __future__ import annotations

import logging
import socket
import threading
import time
import uuid
from abc import ABC, abstractmethod
from typing import Callable, Optional

import paho.mqtt.client as mqtt

# LinkError, parse_url and parse_urls are imported from here by callers too
from edge.wire.brokers import STABLE_S, BrokerList, FailoverClient, LinkError, parse_url, parse_urls  # noqa: F401
from edge.wire.subacks import SubAcks
from edge.wire.tls_failure import tls_failure_message
from edge.wire.topic_match import topic_matches_sub

log = logging.getLogger(__name__)

# kind -> (qos, retain)
KINDS: dict[str, tuple[int, bool]] = {"draft": (0, False), "control": (1, False), "status": (1, True)}

Callback = Callable[[str, bytes], None]


def _check_pattern(pattern: str) -> None:
    levels = pattern.split("/")
    if not pattern or any(("+" in x and x != "+") or ("#" in x and x != "#") for x in levels) \
            or "#" in levels[:-1]:
        raise LinkError(f"bad topic filter {pattern!r}: + and # must fill a whole level, # only last")


def check_topic(topic: str) -> None:
    """Refuse a publish topic with wildcards (every Link implementation checks its topics)."""
    if not topic or "+" in topic or "#" in topic:
        raise LinkError(f"bad topic {topic!r}: publish to a concrete topic, without + or #")


class Link(ABC):
    """Publish bytes to topics, receive them through callbacks."""

    def __init__(self, client_id: Optional[str]) -> None:
        self.client_id = client_id or f"ss-{uuid.uuid4().hex[:12]}"
        self._subs: dict[str, Callback] = {}
        self._listeners: list[Callable[[bool], None]] = []
        self._lock = threading.RLock()
        self.stats = {"sent": 0, "received": 0, "send_failed": 0, "callback_errors": 0}

    # ---- interface ----
    @abstractmethod
    def connect(self, timeout: Optional[float] = 10.0) -> "Link":
        """Connect; wait up to timeout (None: return at once and keep retrying)."""

    @abstractmethod
    def publish(self, topic: str, payload: bytes, kind: str = "control") -> bool:
        """Send with the kind's QoS/retain. False when it did not go out now: a QoS 0
        message is then lost; paho keeps a QoS 1 message and sends it on reconnect."""

    @abstractmethod
    def set_will(self, topic: str, payload: bytes, retain: bool = True) -> None:
        """Message the broker publishes if this link dies without close(); call before connect()."""

    @abstractmethod
    def is_connected(self) -> bool: ...

    @abstractmethod
    def close(self) -> None:
        """Disconnect cleanly (no will) and stop the delivery thread."""

    def subscribe(self, pattern: str, callback: Callback) -> bool:
        """callback(topic, payload) for every message matching pattern; one callback
        per pattern (a second call replaces it). Survives reconnects. On a connected MqttLink it
        returns once the broker answered: True granted, False refused (or no answer in 5 s);
        disconnected, or inside a link callback, it returns True at once (wait_subscribed())."""
        _check_pattern(pattern)
        with self._lock:
            self._subs[pattern] = callback
        return self._subscribe(pattern)

    def unsubscribe(self, pattern: str) -> None:
        with self._lock:
            self._subs.pop(pattern, None)
        self._unsubscribe(pattern)

    def wait_subscribed(self, timeout: Optional[float] = 5.0) -> dict[str, bool]:
        """Block until the link is connected and the broker acknowledged every filter subscribed so
        far on this connection; {pattern: granted} (False: the broker refused it, e.g. its ACL).
        Raises LinkError after `timeout` seconds. (Deliveries are in-process here: connected is enough.)"""
        end = None if timeout is None else time.monotonic() + timeout
        while not self.is_connected():
            if end is not None and time.monotonic() >= end:
                raise LinkError(f"link {self.client_id}: not connected within {timeout:g} s")
            time.sleep(0.01)
        with self._lock:
            return {p: True for p in self._subs}

    @property
    def broker(self) -> str:
        """The broker this link is on now (its URL), for log lines."""
        return getattr(self, "url", None) or getattr(getattr(self, "bus", None), "url", None) or "?"

    def on_connection(self, callback: Callable[[bool], None]) -> None:
        """callback(connected) whenever the link goes up or down."""
        self._listeners.append(callback)

    def __enter__(self) -> "Link":
        return self.connect() if not self.is_connected() else self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- shared plumbing ----
    def _subscribe(self, pattern: str) -> bool:
        return True

    def _unsubscribe(self, pattern: str) -> None:
        pass

    def _qos(self, kind: str) -> tuple[int, bool]:
        try:
            return KINDS[kind]
        except KeyError:
            raise LinkError(f"unknown message kind {kind!r}; one of {sorted(KINDS)}") from None

    def _dispatch(self, topic: str, payload: bytes) -> None:
        self.stats["received"] += 1
        with self._lock:
            matches = [cb for pat, cb in self._subs.items() if topic_matches_sub(pat, topic)]
        for cb in matches:
            try:
                cb(topic, payload)
            except Exception:  # a bad callback must not kill the delivery thread
                self.stats["callback_errors"] += 1
                log.exception("link %s: callback for %s failed", self.client_id, topic)

    def _notify(self, up: bool) -> None:
        for cb in list(self._listeners):
            try:
                cb(up)
            except Exception:
                log.exception("link %s: connection listener failed", self.client_id)


class MqttLink(Link):
    """paho-mqtt 2.x over TCP, MQTT 3.1.1, TCP_NODELAY, reconnect with backoff.

    `url` may name several brokers (the nodes of a cluster, comma-separated or a list): a lost
    connection reconnects to the next one, re-subscribes and tells the connection listeners
    (nodes say hello again, targets' sessions go on).

    With the hub's Mosquitto ACL the username must be the client id the hub
    knows the device by; the MQTT client id gets a random suffix so two links
    of one device do not kick each other off the broker."""

    def __init__(self, url: str, client_id: Optional[str] = None, username: Optional[str] = None,
                 password: Optional[str] = None, keepalive: int = 15,
                 reconnect_delay: tuple[float, float] = (0.1, 5.0),
                 tls: Optional[tuple[str, str, str]] = None) -> None:
        """tls: (CA file, certificate, key) for mqtts:// -- the CA verifies the broker, the
        certificate proves who we are (its CN is our username at the hub's broker)."""
        self.brokers = BrokerList(url)
        url = ",".join(self.brokers.urls)
        host, port, url_user, url_pw = parse_url(self.brokers.current)
        if tls is not None and not url.startswith("mqtts://"):
            raise LinkError(f"TLS files given but {url!r} is not an mqtts:// URL")
        username = username or url_user
        password = password or url_pw
        super().__init__(client_id or (f"{username}-{uuid.uuid4().hex[:6]}" if username else None))
        self.url, self.host, self.port, self.username = url, host, port, username
        self.keepalive = keepalive
        self._up = threading.Event()
        self._refused: Optional[str] = None
        self._subacks = SubAcks(self._lock)
        self._started = False
        self._up_since = 0.0
        self._lost_at: Optional[float] = None   # when the last connection was lost (for the log)
        self._on_url: Optional[str] = None      # the broker of the last connection
        c = FailoverClient(self.brokers, mqtt.CallbackAPIVersion.VERSION2, client_id=self.client_id,
                            protocol=mqtt.MQTTv311, clean_session=True)
        if username:
            c.username_pw_set(username, password)
        self._tls = tls                         # for the errors (edge/wire/tls_failure.py)
        if url.startswith("mqtts://"):
            import ssl
            c.watch_tls = True
            ca, cert, key = tls if tls is not None else (None, None, None)
            try:
                c.tls_set(ca_certs=ca, certfile=cert, keyfile=key, cert_reqs=ssl.CERT_REQUIRED,
                          tls_version=ssl.PROTOCOL_TLS_CLIENT)
            except (OSError, ValueError, ssl.SSLError) as e:
                raise LinkError(f"cannot use the TLS files {tls}: {e}") from None
        c.reconnect_delay_set(*reconnect_delay)
        c.max_inflight_messages_set(0)        # no client-side cap: bursts go straight out
        c.max_queued_messages_set(10000)
        c.on_socket_open = self._on_socket_open
        c.on_connect = self._on_connect
        c.on_disconnect = self._on_disconnect
        c.on_message = self._on_message
        c.on_subscribe = self._on_subscribe
        self._client = c

    # paho callbacks (network thread)
    @staticmethod
    def _on_socket_open(client, userdata, sock) -> None:
        # without NODELAY small messages wait for Nagle + delayed ACK: 40-90 ms stalls
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except OSError:
            pass

    def _on_connect(self, client, userdata, flags, reason_code, properties) -> None:
        client.answered()                       # a CONNACK: no TLS failure (tls_failure.py)
        if reason_code.is_failure:
            self._refused = str(reason_code)
            log.warning("link %s: broker %s refused the connection: %s", self.client_id, self.url, reason_code)
            return
        self._refused = None
        self._up_since = time.monotonic()
        self.host, self.port = client.host, client.port
        self._log_move()
        with self._lock:                        # a subscribe() racing us is sent here or after _up
            self._subacks.reset()
            for p in list(self._subs):          # clean session: subscriptions are ours to restore
                rc, mid = client.subscribe(p, qos=1)
                if rc == mqtt.MQTT_ERR_SUCCESS:
                    self._subacks.sent(p, mid)
            self._up.set()
            self._subacks.changed()
        self._notify(True)

    def _log_move(self) -> None:
        """One INFO line when the link is back after a loss: on which broker, how long after."""
        url, before, lost_at = self.brokers.current, self._on_url, self._lost_at
        self._on_url, self._lost_at = url, None
        n = len(self.brokers.urls)
        if lost_at is not None and url != before:
            log.info("link %s: moved to broker %s (%d of %d in its list) %.2f s after losing %s",
                     self.client_id, url, self.brokers.index + 1, n, time.monotonic() - lost_at, before)
        elif lost_at is not None:
            log.info("link %s: back on broker %s %.2f s after losing it", self.client_id, url,
                     time.monotonic() - lost_at)
        elif before is None and self.brokers.index:
            log.info("link %s: connected to broker %s (%d of %d in its list: the first did not answer)",
                     self.client_id, url, self.brokers.index + 1, n)

    def _on_disconnect(self, client, userdata, flags, reason_code, properties) -> None:
        was_up = self._up.is_set()
        with self._lock:
            self._up.clear()
            self._subacks.reset()               # the broker forgets a clean session's filters
        if was_up and reason_code.is_failure and str(reason_code) != "Keep alive timeout" \
                and time.monotonic() - self._up_since >= STABLE_S:
            client.same_next = True             # the broker itself closed it: it is up
        if was_up:
            self._lost_at = time.monotonic()
            log.info("link %s: disconnected from %s:%s (%s)", self.client_id, self.host, self.port, reason_code)
            self._notify(False)

    def _on_message(self, client, userdata, msg) -> None:
        self._dispatch(msg.topic, msg.payload)

    def _on_subscribe(self, client, userdata, mid, reason_codes, properties) -> None:
        self._subacks.answered(mid, reason_codes)

    # interface
    def connect(self, timeout: Optional[float] = 10.0) -> "MqttLink":
        if not self._started:
            try:
                self._client.connect_async(self.host, self.port, self.keepalive)
            except (OSError, ValueError) as exc:
                raise LinkError(f"cannot connect to {self.url}: {exc}") from None
            self._client.loop_start()
            self._started = True
        if timeout is None:
            return self
        end = time.monotonic() + timeout
        while not self._up.wait(0.02) and self._refused is None and self._client.tls_failure is None \
                and time.monotonic() < end:
            pass                                 # a refusal (bad password, TLS) ends the wait early
        if not self._up.is_set():
            why, tls_failed = self._refused, self._client.tls_failure
            self.close()
            if tls_failed:
                raise LinkError(tls_failure_message(self.url, tls_failed, self._tls))
            if why:
                raise LinkError(f"broker {self.url} refused {self.username or 'anonymous'!r}: {why}; "
                                "check the username (the client id) and password the hub issued")
            if self._client.dropped_unanswered:
                raise LinkError(f"the broker at {self.url} closed our connections before answering them within "
                                f"{timeout:g} s: is the port a TLS listener (then mqtts:// and --tls-dir)?")
            raise LinkError(f"no MQTT broker answered at {self.url} within {timeout:g} s: start one "
                            "(`edge-hub serve`, or `mosquitto -p PORT`) or pass the right --broker URL")
        return self

    def publish(self, topic: str, payload: bytes, kind: str = "control") -> bool:
        check_topic(topic)
        qos, retain = self._qos(kind)
        info = self._client.publish(topic, payload, qos=qos, retain=retain)
        ok = info.rc == mqtt.MQTT_ERR_SUCCESS
        self.stats["sent" if ok else "send_failed"] += 1
        return ok

    def _subscribe(self, pattern: str, wait: float = 5.0) -> bool:
        with self._lock:                        # register before paho can ack
            if not self._up.is_set():
                return True                     # _on_connect subscribes it
            rc, mid = self._client.subscribe(pattern, qos=1)
            if rc != mqtt.MQTT_ERR_SUCCESS:
                return False
            self._subacks.sent(pattern, mid)
        if self._on_network_thread():
            return True                         # inside a callback: the ack needs this thread
        got = self._subacks.wait(lambda: [pattern], self._up.is_set, wait)
        if got is None:
            log.warning("link %s: no SUBACK for %s from %s within %g s", self.client_id, pattern,
                        self.brokers.current, wait)
            return False
        return got[pattern]

    def _on_network_thread(self) -> bool:
        return threading.current_thread() is getattr(self._client, "_thread", None)

    def wait_subscribed(self, timeout: Optional[float] = 5.0) -> dict[str, bool]:
        if self._on_network_thread():
            raise LinkError("wait_subscribed() inside a link callback would wait forever: the "
                            "SUBACKs arrive on this very thread")
        with self._lock:
            got = self._subacks.wait(lambda: list(self._subs), self._up.is_set, timeout)
            if got is not None:
                return got
            state = "connected" if self._up.is_set() else "not connected"
            pending = self._subacks.pending(self._subs) if self._up.is_set() else sorted(self._subs)
        raise LinkError(f"link {self.client_id}: broker {self.brokers.current} ({state}) did not "
                        f"acknowledge {pending} within {timeout:g} s")

    @property
    def broker(self) -> str:
        return self.brokers.current

    def _unsubscribe(self, pattern: str) -> None:
        self._subacks.drop(pattern)
        if self._up.is_set():
            self._client.unsubscribe(pattern)

    def set_will(self, topic: str, payload: bytes, retain: bool = True) -> None:
        check_topic(topic)
        if self._started:
            raise LinkError("set_will must be called before connect()")
        self._client.will_set(topic, payload, qos=1, retain=retain)

    def is_connected(self) -> bool:
        return self._up.is_set()

    def close(self) -> None:
        if not self._started:
            return
        self._started = False
        self._client.disconnect()               # before loop_stop: the other order costs ~1 s
        self._client.loop_stop()
        if self._up.is_set():
            self._up.clear()
            self._notify(False)

    def crash(self) -> None:
        """Die like a killed process (for fault tests): no DISCONNECT, the broker sends the will."""
        if not self._started:
            return
        self._started = False
        sock = self._client.socket()
        self._client.loop_stop()                 # stops the thread without sending DISCONNECT
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            sock.close()
        if self._up.is_set():
            self._up.clear()
            self._notify(False)

