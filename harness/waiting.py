"""Polling for a condition in tests that watch other threads or processes (a timeout, not a timing)."""
from __future__ import annotations

import time


def wait_until(cond, timeout: float = 10.0) -> bool:
    """True once cond() holds (polled every 20 ms), else cond() at the timeout."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.02)
    return cond()
