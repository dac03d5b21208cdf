"""Stop strings in streamed text: cut at the first one, hold back what may be the start of one."""
from __future__ import annotations

from typing import List


class StopText:
    """Cuts generated text at the first stop string; holds back what may start one."""

    def __init__(self, stops: List[str]):
        self.stops = [s for s in stops if s]
        self.text = ""
        self.sent = 0
        self.hit = False

    def feed(self, delta: str) -> str:
        """New text that is safe to emit now."""
        # the text so far holds no stop string (it was cut at one): search only where one could end in
        # delta, so a long answer costs linear time, not quadratic
        before = len(self.text)
        self.text += delta
        for s in self.stops:
            i = self.text.find(s, max(0, before - len(s) + 1))
            if i >= 0:
                self.text, self.hit = self.text[:i], True
        if self.hit:
            return self.flush()
        hold = 0
        for s in self.stops:                   # a suffix that is a prefix of a stop string
            for n in range(min(len(s) - 1, len(self.text)), 0, -1):
                if self.text.endswith(s[:n]):
                    hold = max(hold, n)
                    break
        safe = len(self.text) - hold
        out, self.sent = self.text[self.sent:safe], max(self.sent, safe)
        return out

    def flush(self) -> str:
        out, self.sent = self.text[self.sent:], len(self.text)
        return out
