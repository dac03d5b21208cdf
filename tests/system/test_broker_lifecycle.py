"""A hub's Mosquitto child dies with the hub: kill -9 of the parent must not leave a broker
holding the port (a restarted hub would fail with "Address already in use" and every new
target would decode alone)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from server.broker import find_free_port
from server.mosquitto import MosquittoBroker

ROOT = Path(__file__).resolve().parents[2]

PARENT = """
import threading, time
from server.mosquitto import MosquittoBroker
def start():
    b = MosquittoBroker(port={port}).start()
    print(b.proc.pid, flush=True)
if {in_thread}:      # started off the main thread: no PDEATHSIG, the pid file must do
    t = threading.Thread(target=start); t.start(); t.join()
else:
    start()
time.sleep(120)
"""


def _gone(pid: int, timeout: float) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        try:
            state = Path(f"/proc/{pid}/status").read_text()
        except OSError:
            return True
        if "zombie" in state:
            return True
        time.sleep(0.05)
    return False


def _kill_parent(port: int, in_thread: bool) -> int:
    code = PARENT.format(port=port, in_thread=in_thread)
    # `-c` puts the working directory on sys.path: the repository root, for its packages
    parent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, cwd=ROOT)
    child = int(parent.stdout.readline())
    parent.send_signal(signal.SIGKILL)
    parent.wait(10)
    return child


def test_the_broker_dies_with_its_killed_parent():
    port = find_free_port()
    child = _kill_parent(port, in_thread=False)
    assert _gone(child, 5.0), "mosquitto outlived its killed parent"
    b = MosquittoBroker(port=port).start()          # the port is free again
    b.close()


def test_an_orphan_from_a_killed_hub_is_stopped_by_the_next_start():
    port = find_free_port()
    child = _kill_parent(port, in_thread=True)
    try:
        assert not _gone(child, 0.5), "expected an orphan here (no PDEATHSIG off the main thread)"
        b = MosquittoBroker(port=port).start()      # finds the pid file, stops the orphan, listens
        assert _gone(child, 1.0)
        b.close()
    finally:
        if not _gone(child, 0):
            os.kill(child, signal.SIGKILL)


def test_a_live_brokers_port_is_never_taken_over(mosquitto):
    from server.broker import BrokerError
    with pytest.raises(BrokerError, match="cannot listen"):
        MosquittoBroker(port=mosquitto.port).start(timeout=3)
    assert mosquitto.proc.poll() is None            # the live one is untouched
