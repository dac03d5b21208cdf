"""A demo's live table (server/demos/star_demo.py, sun_demo.py): redrawn in place on a terminal,
printed every `every_s` seconds elsewhere (a log keeps a few snapshots, not hundreds); then the
final table in its place."""
from __future__ import annotations

from typing import Callable, List


class LiveTable:
    def __init__(self, out, live: bool = True, every_s: float = 5.0):
        self.out, self.live, self.every_s = out, live, every_s
        self.tty = live and hasattr(out, "isatty") and out.isatty()
        self._shown, self._last = 0, 0.0       # lines on screen, when they were drawn

    def update(self, now: float, rows: Callable[[], List[str]]) -> None:
        """Show rows() when one is due at `now` (seconds into the run)."""
        if self.live and (self.tty or now - self._last >= self.every_s):
            lines = rows()
            self._erase()
            self.out.write("\n".join(lines) + "\n")
            self.out.flush()
            self._shown, self._last = len(lines), now

    def final(self, lines: List[str]) -> None:
        self._erase()
        self.out.write("\n".join(lines) + "\n")

    def _erase(self) -> None:
        if self.tty and self._shown:
            self.out.write(f"\x1b[{self._shown}F\x1b[J")      # redraw in place
