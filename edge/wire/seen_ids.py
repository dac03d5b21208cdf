"""A bounded memory of recent ids, so a replayed job or request is dropped, not served twice."""
from __future__ import annotations

from collections import deque
from typing import Hashable


class SeenIds:
    """The last `size` ids added; the oldest is forgotten first (memory stays bounded)."""

    def __init__(self, size: int = 65536):
        self._order: deque = deque(maxlen=size)
        self._set: set = set()

    def add(self, key: Hashable) -> bool:
        """Remember key; False if it was seen already (a replay)."""
        if key in self._set:
            return False
        if len(self._order) == self._order.maxlen:
            self._set.discard(self._order[0])
        self._order.append(key)
        self._set.add(key)
        return True

    def __contains__(self, key: Hashable) -> bool:
        return key in self._set

    def __len__(self) -> int:
        return len(self._order)
