"""MQTT topic-filter matching, as paho-mqtt's `topic_matches_sub` answers it, without its cost.

paho builds a one-filter prefix tree per call; a link matches every message it delivers against
every filter it holds (edge/wire/link.py, and the in-memory bus once more for each link), so on the
star's message path that was a tenth of the CPU. Same answers (tests/unit/test_topic_match.py
compares them with paho's): `+` one level, a last `#` the rest (the parent level too), and
wildcards at the first level never match a topic that starts with `$`.
"""
from __future__ import annotations

from functools import lru_cache


@lru_cache(maxsize=4096)
def _levels(sub: str) -> tuple:
    return tuple(sub.split("/"))


def topic_matches_sub(sub: str, topic: str) -> bool:
    """Whether `topic` matches the subscription filter `sub`."""
    f, t = _levels(sub), topic.split("/")
    wild_first = not topic.startswith("$")       # may a wildcard match the first level?
    last = len(f) - 1
    for i, level in enumerate(t):
        if i > last:
            return False
        if f[i] == "#" and i == last and (wild_first or i > 0):
            return True
        if f[i] != level and not (f[i] == "+" and (wild_first or i > 0)):
            return False
    i = len(t)                                    # every level of the topic matched
    return i == last + 1 or (i == last and f[i] == "#" and (wild_first or i > 0))
