"""harness/netns.py itself: hosts reach each other over the switch and the test reaches
them off it; a pulled cable stalls a live TCP connection (no reset, no close) that carries
on once the cable is back; close() leaves nothing, and a crashed run's leftovers are removed."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from harness.netns import PREFIX, NetLab, available, ip, remove_leftovers

if os.geteuid() != 0:
    pytest.skip("network namespaces need root (CAP_NET_ADMIN)", allow_module_level=True)

ECHO = """
import socket, sys
s = socket.create_server((sys.argv[1], 7007))
print("listening", flush=True)
c, _ = s.accept()
while True:
    d = c.recv(100)
    if not d:
        break
    c.sendall(d)
"""

CLIENT = """
import socket, sys
c = socket.create_connection((sys.argv[1], 7007), timeout=5)
c.sendall(b"one"); print("echo", c.recv(10).decode(), flush=True)
sys.stdin.readline()                       # the cable is pulled now
c.settimeout(1.0); c.sendall(b"two")
try:
    c.recv(10); print("not stalled", flush=True)
except socket.timeout:
    print("stalled", flush=True)
sys.stdin.readline()                       # the cable is back
c.settimeout(30); print("echo", c.recv(10).decode(), flush=True)
"""


def _line(p) -> str:
    return p.stdout.readline().strip()


def test_a_pulled_cable_stalls_a_tcp_connection_that_resumes_when_it_is_back():
    assert not available(), available()
    with NetLab() as lab:
        hub, dev = lab.add("hub"), lab.add("dev")
        server = subprocess.Popen(hub.cmd(sys.executable, "-c", ECHO, hub.ip), stdout=subprocess.PIPE, text=True)
        client = None
        try:
            assert _line(server) == "listening"
            client = subprocess.Popen(dev.cmd(sys.executable, "-c", CLIENT, hub.ip), stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, text=True)
            assert _line(client) == "echo one"                   # across the switch
            lab.cut(dev)
            client.stdin.write("\n")
            client.stdin.flush()
            assert _line(client) == "stalled"                    # no error, no reset: packets just vanish
            lab.heal(dev)
            client.stdin.write("\n")
            client.stdin.flush()
            assert _line(client) == "echo two"                   # the same connection carries on
            assert client.wait(10) == 0
        finally:
            for p in (server, client):
                if p is not None and p.poll() is None:
                    p.kill()
                    p.wait()
        namespaces = [hub.ns, dev.ns, lab.switch]
    left = ip("netns", "list")
    assert not any(ns in left for ns in namespaces), left
    assert f"{PREFIX}{os.getpid()}m" not in ip("-o", "link", "show")


def test_leftovers_of_a_crashed_run_are_removed():
    with open("/proc/sys/kernel/pid_max") as f:     # above pid_max: no process has this pid
        dead = int(f.read()) + 1 + os.getpid() % 1000
    ns, link = f"{PREFIX}-{dead}-hub", f"{PREFIX}{dead}m1"[:15]
    ip("netns", "add", ns)
    ip("link", "add", link, "type", "veth", "peer", "name", "mgmt0", "netns", ns)
    orphan = subprocess.Popen(["ip", "netns", "exec", ns, "sleep", "600"])   # what a killed run left running
    mine = f"{PREFIX}-{os.getpid()}-mine"           # a live run's namespace stays
    ip("netns", "add", mine)
    try:
        gone = remove_leftovers()
        assert ns in gone and ns not in ip("netns", "list")
        assert link not in ip("-o", "link", "show")
        assert mine in ip("netns", "list")
        assert orphan.wait(10) == -9                  # killed with its namespace
    finally:
        if orphan.poll() is None:
            orphan.kill()
        for n in (ns, mine):
            ip("netns", "del", n, check=False)
        ip("link", "del", link, check=False)


def test_close_removes_everything_even_when_the_test_fails():
    with pytest.raises(RuntimeError):
        with NetLab() as lab:
            h = lab.add("x")
            raise RuntimeError("a failing test")
    assert h.ns not in ip("netns", "list") and lab.switch not in ip("netns", "list")
    with pytest.raises(ValueError, match="lowercase"):
        with NetLab() as lab:
            lab.add("Bad/Name")
