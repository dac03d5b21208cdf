"""Which subscriptions the broker has acknowledged (SUBACK) on the link's current connection.

MqttLink (edge/wire/link.py) records each SUBSCRIBE it sends by its packet id (mid): from
subscribe(), and from the re-subscription after every (re)connect. paho's on_subscribe answers
by mid; the filter is then granted (True) or refused (False: an ACL said no). A lost connection
forgets them all: the broker forgets a clean session's subscriptions too, and they are sent again.
`wait` blocks until the filters asked about are answered -- what a test (or a role) waits on
instead of sleeping until "the SUBSCRIBE reached the broker".
"""
from __future__ import annotations

import threading
import time
from typing import Callable, Iterable, Optional


class SubAcks:
    """pattern -> None (sent, unanswered) | True (granted) | False (refused), per connection."""

    def __init__(self, lock) -> None:
        self._cv = threading.Condition(lock)     # the link's own lock: one order, no deadlock
        self._state: dict[str, Optional[bool]] = {}
        self._mids: dict[int, str] = {}

    def sent(self, pattern: str, mid: int) -> None:
        """A SUBSCRIBE for pattern went out as packet `mid` (register it before the ack can come)."""
        with self._cv:
            self._state[pattern] = None
            self._mids[mid] = pattern

    def answered(self, mid: int, reason_codes) -> None:
        """paho's on_subscribe: the broker answered packet `mid` (one reason code per filter)."""
        with self._cv:
            pattern = self._mids.pop(mid, None)
            if pattern is None or pattern not in self._state:
                return                           # from an earlier connection, or unsubscribed since
            codes = list(reason_codes)
            self._state[pattern] = bool(codes) and not any(c.is_failure for c in codes)
            self._cv.notify_all()

    def drop(self, pattern: str) -> None:
        with self._cv:
            self._state.pop(pattern, None)

    def reset(self) -> None:
        """The connection is gone: nothing is subscribed at the broker any more."""
        with self._cv:
            self._state.clear()
            self._mids.clear()
            self._cv.notify_all()

    def changed(self) -> None:
        """Wake waiters (the link came up)."""
        with self._cv:
            self._cv.notify_all()

    def wait(self, patterns: Callable[[], Iterable[str]], up: Callable[[], bool],
             timeout: Optional[float]) -> Optional[dict]:
        """{pattern: granted} once up() holds and every pattern (read again at each wake-up) is
        answered; None at the timeout (None: no timeout)."""
        end = None if timeout is None else time.monotonic() + timeout
        with self._cv:
            while True:
                if up():
                    want = list(patterns())
                    if all(self._state.get(p) is not None for p in want):
                        return {p: bool(self._state[p]) for p in want}
                left = None if end is None else end - time.monotonic()
                if left is not None and left <= 0:
                    return None
                # (a link going up notifies; the cap only bounds a missed wake-up)
                self._cv.wait(0.5 if left is None else min(left, 0.5))

    def pending(self, patterns: Iterable[str]) -> list:
        with self._cv:
            return [p for p in patterns if self._state.get(p) is None]
