"""MQTT brokers for the hub and the tests: embedded amqtt, or a Mosquitto process.

Both isolate sessions with the same access table (server/acl.py) when
`acl=True`: Mosquitto gets it as an ACL file (patterns with %u) plus a
password file; amqtt gets it as in-process plugins.
"""
from __future__ import annotations

import asyncio
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from amqtt.broker import Broker
from amqtt.contexts import Action
from amqtt.plugins.base import BaseAuthPlugin, BaseTopicPlugin

from server.acl import Acl, AclError


class BrokerError(RuntimeError):
    """A broker could not be started or configured; the message says what to do."""


def find_free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _check_port_free(host: str, port: int) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as exc:
            raise BrokerError(f"cannot listen on {host}:{port} ({exc.strerror}): another broker "
                              "may be running there; stop it or pick another port") from None


def _wait_port(host: str, port: int, timeout: float, alive=lambda: True) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end and alive():
        try:
            with socket.create_connection((host, port), timeout=0.2):
                return True
        except OSError:
            time.sleep(0.01)
    return False


class AclAuthPlugin(BaseAuthPlugin):
    """amqtt: username/password from the shared Acl."""

    @dataclass
    class Config:
        acl: Any = None

    async def authenticate(self, *, session) -> bool:
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


class _BrokerBase:
    host: str
    port: int
    acl: Optional[Acl]

    @property
    def url(self) -> str:
        return f"mqtt://{self.host}:{self.port}"

    def add_user(self, name: str, role: str = "client", password: Optional[str] = None) -> str:
        """Register a user (clients: name = client id); returns its password."""
        if self.acl is None:
            raise BrokerError("this broker runs without an ACL (acl=False): anyone may connect")
        try:
            pw = self.acl.add(name, role, password)
        except AclError as e:
            raise BrokerError(str(e)) from None
        self._reload(name)
        return pw

    def password(self, name: str) -> str:
        return self.acl.users[name][1] if self.acl else ""

    def _reload(self, name: str) -> None:
        pass                                      # amqtt reads the shared Acl live

    def __enter__(self):
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


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
                 hub_user: str = "hub") -> None:
        self.host, self.port = host, port or find_free_port(host)
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
        return {"listeners": {"default": {"type": "tcp", "bind": f"{self.host}:{self.port}"}},
                "plugins": plugins}

    def start(self, timeout: float = 10.0) -> "EmbeddedBroker":
        if self._thread:
            return self
        _check_port_free(self.host, self.port)
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


class MosquittoBroker(_BrokerBase):
    """A mosquitto process on a loopback port, configured in a temp dir."""

    def __init__(self, port: Optional[int] = None, host: str = "127.0.0.1", acl: bool = False,
                 hub_user: str = "hub", workdir: Optional[str] = None) -> None:
        self.exe = shutil.which("mosquitto") or next(
            (p for p in ("/usr/sbin/mosquitto", "/usr/local/sbin/mosquitto") if os.access(p, os.X_OK)), None)
        if not self.exe:
            raise BrokerError("mosquitto is not installed: `apt-get install mosquitto` "
                              "(or `brew install mosquitto`), or use the embedded broker")
        self.host, self.port = host, port or find_free_port(host)
        self.acl = Acl() if acl else None
        self.hub_user = hub_user
        self.hub_password = self.acl.add(hub_user, "hub") if self.acl else ""
        self._own_dir = workdir is None
        self.dir = Path(workdir or tempfile.mkdtemp(prefix="ss-mosquitto-"))
        self.proc: Optional[subprocess.Popen] = None

    def _write_files(self) -> None:
        conf = [f"listener {self.port} {self.host}", "set_tcp_nodelay true", "max_queued_messages 0",
                "persistence false", f"log_dest file {self.dir / 'mosquitto.log'}",
                "log_type error", "log_type warning", "log_type notice", "log_type information"]
        if os.geteuid() == 0:
            conf.append("user root")               # else it drops to 'mosquitto' and cannot read dir
        if self.acl:
            conf += ["allow_anonymous false", f"password_file {self.dir / 'passwd'}",
                     f"acl_file {self.dir / 'acl'}"]
            path = self.dir / "passwd"
            path.write_text("")
            path.chmod(0o600)
            for name in self.acl.users:
                self._write_password(name)
            (self.dir / "acl").write_text(self.acl.mosquitto_acl())
        else:
            conf.append("allow_anonymous true")
        (self.dir / "mosquitto.conf").write_text("\n".join(conf) + "\n")

    def _write_password(self, name: str) -> None:
        tool = shutil.which("mosquitto_passwd") or "/usr/bin/mosquitto_passwd"
        r = subprocess.run([tool, "-b", str(self.dir / "passwd"), name, self.acl.users[name][1]],
                           capture_output=True, text=True)
        if r.returncode:
            raise BrokerError(f"mosquitto_passwd failed for {name!r}: {r.stderr.strip() or r.stdout.strip()}")

    def _reload(self, name: str) -> None:
        if self.proc and self.proc.poll() is None:
            self._write_password(name)
            (self.dir / "acl").write_text(self.acl.mosquitto_acl())
            before = self._log_count("Reloading config.")
            self.proc.send_signal(signal.SIGHUP)   # mosquitto re-reads password and ACL files
            end = time.monotonic() + 5              # single-threaded: once logged, it is done
            while self._log_count("Reloading config.") == before and time.monotonic() < end:
                time.sleep(0.005)

    def _log_count(self, text: str) -> int:
        p = self.dir / "mosquitto.log"
        return p.read_text(errors="replace").count(text) if p.exists() else 0

    def log_tail(self, n: int = 20) -> str:
        p = self.dir / "mosquitto.log"
        return "\n".join(p.read_text(errors="replace").splitlines()[-n:]) if p.exists() else ""

    def start(self, timeout: float = 10.0) -> "MosquittoBroker":
        if self.proc and self.proc.poll() is None:
            return self
        _check_port_free(self.host, self.port)
        self._write_files()
        self.proc = subprocess.Popen([self.exe, "-c", str(self.dir / "mosquitto.conf")],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        if not _wait_port(self.host, self.port, timeout, alive=lambda: self.proc.poll() is None):
            err = self.proc.stderr.read().decode(errors="replace") if self.proc.poll() is not None else ""
            self.stop()
            raise BrokerError(f"mosquitto did not start on {self.host}:{self.port}: "
                              f"{(err + self.log_tail()).strip() or 'timed out'}")
        return self

    def stop(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        if self.proc.stderr:
            self.proc.stderr.close()
        self.proc = None

    def close(self) -> None:
        """Stop and remove the temp dir."""
        self.stop()
        if self._own_dir:
            shutil.rmtree(self.dir, ignore_errors=True)

    def __exit__(self, *exc) -> None:
        self.close()


def start_broker(kind: str = "auto", port: Optional[int] = None, acl: bool = False):
    """kind: 'mosquitto', 'embedded' or 'auto' (Mosquitto when installed)."""
    if kind == "auto":
        kind = "mosquitto" if shutil.which("mosquitto") or os.path.exists("/usr/sbin/mosquitto") else "embedded"
    if kind not in ("mosquitto", "embedded"):
        raise BrokerError(f"broker kind must be mosquitto, embedded or auto, got {kind!r}")
    cls = MosquittoBroker if kind == "mosquitto" else EmbeddedBroker
    return cls(port=port, acl=acl).start()
