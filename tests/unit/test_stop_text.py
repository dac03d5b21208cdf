"""StopText searches only where a stop string can end in the new text: it cuts and holds back
exactly as a search over the whole text did (the reference below), whatever the pieces."""
import random
from typing import List

from edge.api.stop_text import StopText


class WholeTextStopText:
    """The former StopText.feed, searching the whole text each time."""

    def __init__(self, stops: List[str]):
        self.stops, self.text, self.sent, self.hit = [s for s in stops if s], "", 0, False

    def feed(self, delta: str) -> str:
        self.text += delta
        for s in self.stops:
            i = self.text.find(s)
            if i >= 0:
                self.text, self.hit = self.text[:i], True
        if self.hit:
            out, self.sent = self.text[self.sent:], len(self.text)
            return out
        hold = 0
        for s in self.stops:
            for n in range(min(len(s) - 1, len(self.text)), 0, -1):
                if self.text.endswith(s[:n]):
                    hold = max(hold, n)
                    break
        safe = len(self.text) - hold
        out, self.sent = self.text[self.sent:safe], max(self.sent, safe)
        return out


def test_cuts_as_a_whole_text_search_does():
    rng = random.Random(7)
    for _ in range(3000):
        stops = ["".join(rng.choice("ab") for _ in range(rng.randint(1, 4))) for _ in range(rng.randint(1, 3))]
        fast, ref = StopText(stops), WholeTextStopText(stops)
        while not ref.hit and len(ref.text) < 40:
            delta = "".join(rng.choice("abc") for _ in range(rng.randint(0, 5)))
            assert fast.feed(delta) == ref.feed(delta)
            assert (fast.text, fast.sent, fast.hit) == (ref.text, ref.sent, ref.hit)
        assert fast.flush() == ref.text[ref.sent:]
