"""What both brokers share: errors, listeners, ports, users."""
from __future__ import annotations

import ipaddress
import socket
import time
from dataclasses import dataclass
from typing import Any, Optional

from server.acl import Acl, AclError


class BrokerError(RuntimeError):
    """A broker could not be started or configured; the message says what to do."""


@dataclass(frozen=True)
class Listener:
    """One address the broker listens on; `tls` (a server.certs.TlsFiles) makes it mqtts,
    with client certificates required and each client's certificate CN as its username."""
    host: str
    port: int
    tls: Any = None

    @property
    def loopback(self) -> bool:
        return is_loopback(self.host)

    @property
    def url(self) -> str:
        return f"{'mqtts' if self.tls else 'mqtt'}://{self.host}:{self.port}"


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


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
