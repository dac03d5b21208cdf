"""harness/delay_proxy.py, the stand-in for netem: bytes pass unchanged and in order, each
direction at least its minimum one-way delay later (a sleep never ends early, so this lower
bound holds on any machine), and the delay changes while it runs."""
from __future__ import annotations

import socket
import threading
import time

import pytest

from harness.delay_proxy import PROFILES, Delay, ProxyThread


@pytest.fixture
def echo_through_proxy():
    """An echo server behind a proxy of (mean 20 ms, jitter 10 ms) each way: (port, up, down)."""
    echo = socket.create_server(("127.0.0.1", 0))

    def run_echo():
        conn, _ = echo.accept()
        with conn:
            data = conn.recv(65536)
            while data:
                conn.sendall(data)
                data = conn.recv(65536)
    threading.Thread(target=run_echo, daemon=True).start()
    with ProxyThread(echo.getsockname()) as proxy:
        proxy.set("20 10")
        yield proxy.port, proxy.up, proxy.down
    echo.close()


def test_bytes_arrive_unchanged_in_order_and_no_earlier_than_the_delay(echo_through_proxy):
    port, up, down = echo_through_proxy
    with socket.create_connection(("127.0.0.1", port), timeout=10) as c:
        sent, got, rtts = b"", b"", []
        for i in range(30):
            msg = f"<{i}:{'x' * (i * 37 % 500)}>".encode()
            sent += msg
            t0 = time.monotonic()
            c.sendall(msg)
            while len(got) < len(sent):
                got += c.recv(65536)
            rtts.append(time.monotonic() - t0)
        assert got == sent                                      # byte stream intact, order kept
        assert min(rtts) >= 2 * 0.010                           # at least mean - jitter, each way
        down.set("none")
        up.set("none")
        t0 = time.monotonic()
        c.sendall(b"fast")
        assert c.recv(16) == b"fast"
        up.corrupt_next = 1                                     # the tampering middlebox: one byte
        c.sendall(b"abcdefgh")
        back = c.recv(16)
        assert len(back) == 8 and sum(x != y for x, y in zip(back, b"abcdefgh")) == 1, back
    assert up.mean_ms == 0 and up.sample_s() == 0.0


def test_profiles_and_bad_specs():
    d = Delay()
    assert d.set("cellular") == "delay 40+-15 ms" and (d.mean_ms, d.jitter_ms) == PROFILES["cellular"]
    assert d.set("7 2") == "delay 7+-2 ms"
    assert all(0.005 <= d.sample_s() <= 0.009 for _ in range(200))
    with pytest.raises(ValueError, match="profile"):
        d.set("satellite")
    with pytest.raises(ValueError, match="not negative"):
        d.set("-1 0")
