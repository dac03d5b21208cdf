"""Network namespaces for system tests: a star of hosts on one switch, and a management link
from the test (the root namespace) to each host.

    with NetLab() as lab:
        hub, t1 = lab.add("hub"), lab.add("t1")
        subprocess.Popen(hub.cmd("mosquitto", ...))     # runs inside the hub's namespace
        lab.cut(t1); ...; lab.heal(t1)                    # a pulled cable: packets vanish

Topology (addresses from a 10.X.Y.0/23 no route of this machine uses):

    host ns  star0 10.X.Y.i/24 ----- port p-<name> on bridge br0 in the switch ns (the star network)
             mgmt0 10.X.Y+1.4i+2/30 - sst<pid>m<i> 10.X.Y+1.4i+1 in the root ns (the test's own link)

The root namespace reaches each host's star address over that host's management link (a /32
route), so the test's clients and HTTP requests never cross the switch and keep working while
a host's switch port is down. Only root may do this (CAP_NET_ADMIN); `ip` comes from iproute2
(scripts/ensure_system.sh netns installs it). Everything is named with the prefix `sst-<pid>-`
(links: `sst<pid>m`), torn down on close, and leftovers of an earlier run whose process is gone
are removed on the next start.
"""
from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
from contextlib import contextmanager
from dataclasses import dataclass
from typing import List

PREFIX = "sst"


class NetnsError(RuntimeError):
    """The namespaces could not be made; the message says why (not root, no iproute2)."""


def ip(*args: str, check: bool = True) -> str:
    r = subprocess.run(["ip", *args], capture_output=True, text=True)
    if check and r.returncode:
        raise NetnsError(f"`ip {' '.join(args)}` failed: {r.stderr.strip()}")
    return r.stdout


def available() -> str:
    """'' when namespaces can be made here, else why not (with what to do)."""
    if shutil.which("ip") is None:
        return "iproute2 is not installed: run `bash scripts/ensure_system.sh netns`"
    if os.geteuid() != 0:
        return "network namespaces need root (CAP_NET_ADMIN)"
    return ""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


def delete_namespace(name: str) -> None:
    """Kill what still runs inside (a namespace lives on while a process holds it), then delete it."""
    for pid in ip("netns", "pids", name, check=False).split():
        try:
            os.kill(int(pid), signal.SIGKILL)
        except (ProcessLookupError, ValueError):
            pass
    ip("netns", "del", name, check=False)


def remove_leftovers() -> List[str]:
    """Delete namespaces (and what runs in them) and root links of earlier runs whose process
    is gone; -> their names."""
    gone = []
    for line in ip("netns", "list", check=False).splitlines():
        name = line.split()[0] if line.split() else ""
        m = re.fullmatch(rf"{PREFIX}-(\d+)-.+", name)
        if m and not _alive(int(m.group(1))):
            delete_namespace(name)
            gone.append(name)
    for m in re.finditer(rf"^\d+: ({PREFIX}(\d+)m\d+)[@:]", ip("-o", "link", "show", check=False), re.M):
        if not _alive(int(m.group(2))):
            ip("link", "del", m.group(1), check=False)
            gone.append(m.group(1))
    return gone


def _free_subnet() -> tuple[int, int]:
    """(X, Y) with 10.X.Y.0/23 unused by any route here (pid-seeded, so parallel runs differ)."""
    routes = ip("-4", "route", "show", "table", "all", check=False)
    pid = os.getpid()
    for k in range(2000):
        n = (pid * 7 + k) % (100 * 128)
        x, y = 100 + n // 128, 2 * (n % 128)
        if f"10.{x}.{y}." not in routes and f"10.{x}.{y + 1}." not in routes:
            return x, y
    raise NetnsError("no free 10.X.Y.0/23 for the test's namespaces")


@dataclass
class Host:
    name: str
    ns: str            # its network namespace
    ip: str            # its address on the star network
    port: str          # its port on the switch (cut / heal)
    index: int

    def cmd(self, *args) -> List[str]:
        """argv that runs `args` inside this host's namespace."""
        return ["ip", "netns", "exec", self.ns, *[str(a) for a in args]]


class NetLab:
    """Hosts in namespaces of their own on one switch; close() removes everything."""

    def __init__(self) -> None:
        why = available()
        if why:
            raise NetnsError(why)
        remove_leftovers()
        self.pid = os.getpid()
        self.x, self.y = _free_subnet()
        self.hosts: dict[str, Host] = {}
        self._root_links: List[str] = []
        self.switch = f"{PREFIX}-{self.pid}-switch"
        try:
            ip("netns", "add", self.switch)
            self._in(self.switch, "link", "add", "br0", "type", "bridge")
            self._in(self.switch, "link", "set", "br0", "up")
        except Exception:
            self.close()
            raise

    def _in(self, ns: str, *args: str) -> str:
        return ip("-n", ns, *args)

    def add(self, name: str) -> Host:
        """A host `name` with its own namespace, a switch port and a management link."""
        if not re.fullmatch(r"[a-z][a-z0-9]{0,9}", name) or name in self.hosts:
            raise ValueError(f"host name {name!r}: 1-10 lowercase letters/digits, unique")
        i = len(self.hosts) + 1
        if i > 60:
            raise NetnsError("at most 60 hosts per lab")
        h = Host(name, f"{PREFIX}-{self.pid}-{name}", f"10.{self.x}.{self.y}.{i}", f"p-{name}", i)
        self.hosts[name] = h
        ip("netns", "add", h.ns)
        self._in(h.ns, "link", "set", "lo", "up")
        # the star: star0 in the host, its peer a port of the switch's bridge
        ip("link", "add", "star0", "netns", h.ns, "type", "veth", "peer", "name", h.port, "netns", self.switch)
        self._in(self.switch, "link", "set", "dev", h.port, "master", "br0", "up")
        self._in(h.ns, "addr", "add", f"{h.ip}/24", "dev", "star0")
        self._in(h.ns, "link", "set", "star0", "up")
        # the test's own link: root end sst<pid>m<i>, host end mgmt0, a /30 of 10.X.Y+1
        root_end = f"{PREFIX}{self.pid}m{i}"
        ip("link", "add", root_end, "type", "veth", "peer", "name", "mgmt0", "netns", h.ns)
        self._root_links.append(root_end)
        a, b = f"10.{self.x}.{self.y + 1}.{4 * i + 1}", f"10.{self.x}.{self.y + 1}.{4 * i + 2}"
        ip("addr", "add", f"{a}/30", "dev", root_end)
        ip("link", "set", root_end, "up")
        self._in(h.ns, "addr", "add", f"{b}/30", "dev", "mgmt0")
        self._in(h.ns, "link", "set", "mgmt0", "up")
        ip("route", "add", f"{h.ip}/32", "via", b, "dev", root_end)   # the test reaches it off the switch
        return h

    # ---- faults ----
    def cut(self, host: Host) -> None:
        """Pull the host's cable: its switch port goes down, its packets vanish (no RST, no FIN),
        its TCP connections stay open and retransmit into the void until heal()."""
        self._in(self.switch, "link", "set", "dev", host.port, "down")

    def heal(self, host: Host) -> None:
        self._in(self.switch, "link", "set", "dev", host.port, "up")

    @contextmanager
    def partitioned(self, host: Host):
        self.cut(host)
        try:
            yield
        finally:
            self.heal(host)

    def close(self) -> None:
        """Delete every namespace, killing what still runs there (their veths and the root ends
        go with them)."""
        for h in list(self.hosts.values()):
            delete_namespace(h.ns)
        delete_namespace(self.switch)
        for link in self._root_links:           # already gone with their peers; be sure
            ip("link", "del", link, check=False)
        self.hosts.clear()

    def __enter__(self) -> "NetLab":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def netem_available() -> bool:
    """Whether this kernel has the netem qdisc (tried on a throwaway namespace's loopback)."""
    ns = f"{PREFIX}-{os.getpid()}-netem-probe"
    ip("netns", "add", ns, check=False)
    try:
        r = subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", "lo", "root", "netem",
                            "delay", "1ms"], capture_output=True, text=True)
        return r.returncode == 0
    finally:
        ip("netns", "del", ns, check=False)
