"""Sampling a live star's queues and memory while it is under load (the load test, the soak, load.py).

`Monitor` polls named probes (callables returning a number) on its own thread and keeps
every sample; a probe that raises (a dict resized under it by the loop thread) skips that
sample. The checks read counts and bytes, never clocks: `peak` for "bounded by the configured
limit", `flat` for "RSS does not grow" and `no_growth` for "no queue grows" over a soak.
"""
from __future__ import annotations

import statistics
import threading
import time
from typing import Callable, Dict, List, Optional, Tuple


def rss_mb(pid: Optional[int] = None) -> float:
    """Resident memory of a process (this one by default), MB."""
    with open(f"/proc/{pid or 'self'}/status") as f:
        return next(int(ln.split()[1]) for ln in f if ln.startswith("VmRSS:")) / 1024


class Monitor:
    def __init__(self, probes: Dict[str, Callable[[], float]], every_s: float = 0.05):
        self.probes, self.every_s = dict(probes), every_s
        self.samples: Dict[str, List[Tuple[float, float]]] = {k: [] for k in self.probes}
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def __enter__(self) -> "Monitor":
        self._thread = threading.Thread(target=self._run, name="load-monitor", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(10)
        self.sample()                                      # the state at the end, too

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            self.sample()

    def sample(self) -> None:
        now = time.monotonic()
        for name, probe in self.probes.items():
            try:
                v = float(probe())
            except Exception:  # noqa: BLE001 - a racing read; the next sample will do
                continue
            self.samples[name].append((now, v))

    def values(self, name: str, window: Optional[Tuple[float, float]] = None) -> List[float]:
        """The samples of `name`, only those taken inside `window` (monotonic times) if given."""
        return [v for t, v in self.samples[name] if window is None or window[0] <= t <= window[1]]

    def peak(self, name: str) -> float:
        vals = self.values(name)
        return max(vals) if vals else 0.0

    def thirds(self, name: str, skip_frac: float = 0.2,
               window: Optional[Tuple[float, float]] = None) -> Tuple[List[float], List[float]]:
        """The first and last thirds of the samples (in `window`) after the first `skip_frac` (warm-up)."""
        vals = self.values(name, window)
        vals = vals[int(len(vals) * skip_frac):]
        k = max(1, len(vals) // 3)
        return vals[:k], vals[-k:]

    def flat(self, name: str, frac: float = 0.10, abs_mb: float = 8.0,
             window: Optional[Tuple[float, float]] = None) -> Tuple[bool, str]:
        """Last third's median within max(frac, abs) of the first third's (after warm-up)."""
        a, b = self.thirds(name, window=window)
        m0, m1 = statistics.median(a), statistics.median(b)
        allowed = max(frac * m0, abs_mb)
        return m1 - m0 <= allowed, (f"{name}: first-third median {m0:.1f}, last-third median {m1:.1f} "
                                    f"(allowed +{allowed:.1f})")

    def no_growth(self, name: str, slack: float = 0.0,
                  window: Optional[Tuple[float, float]] = None) -> Tuple[bool, str]:
        """A queue that leaks climbs: its last third's median would pass the first third's peak."""
        a, b = self.thirds(name, window=window)
        ok = statistics.median(b) <= max(a) + slack
        return ok, f"{name}: first-third max {max(a):g}, last-third median {statistics.median(b):g}"
