"""What a device reports about itself: machine readings plus its role's own counters.

`SystemSampler` reads the machine: psutil on any Linux (process RSS, available memory,
CPU load, temperatures where the kernel shows them); on a Jetson also GPU load, power and
the SoC's temperatures, from jetson-stats' jtop when it is installed (its service does the
reading without root), else from `tegrastats` (edge/telemetry/tegrastats.py).

`TelemetryReporter` turns one sample and the role's counters into a Telemetry message
(edge/wire/protocol.py), with rates (tok/s, busy ratio) over the time since its last report.
The counters come from the role's own `telemetry()` hook (edge/runtime/node.py and its
subclasses, StarTarget, the hub), a dict with any of:

    sessions         sessions / requests the role holds now
    tokens           tokens produced since start (drafted, decoded, generated)
    busy_s, wall_s   seconds busy and seconds accounted, cumulative (busy ratio = d busy / d wall)
    accepted, drafted   cumulative drafted tokens the target accepted / was offered
    batch_mean, batch_max
    kv_used_bytes, kv_budget_bytes
    dropped          messages dropped: a count, or a dict of counts by reason

Nothing here keeps counters of its own: the roles already do.
"""
from __future__ import annotations

import logging
import os
import shutil
import threading
import time
from dataclasses import dataclass
from typing import Callable, Optional

import psutil

from edge.wire.protocol import Telemetry
from edge.telemetry.tegrastats import TegraSample, TegrastatsReader

log = logging.getLogger(__name__)
MB = 1e6
GPU_SOURCES = ("auto", "jtop", "tegrastats", "none")


@dataclass
class SystemSample:
    rss_mb: float
    mem_avail_mb: float
    mem_total_mb: float
    cpu_pct: float
    gpu_pct: Optional[float] = None
    temp_c: Optional[float] = None
    power_w: Optional[float] = None
    source: str = "psutil"


class JtopSource:
    """jetson-stats' jtop (needs its jtop.service on the board); `latest()` as a TegraSample."""

    def __init__(self) -> None:
        from jtop import jtop                     # jetson-stats; ImportError when not installed
        self._jetson = jtop()
        self._jetson.start()

    def latest(self) -> Optional[TegraSample]:
        stats = dict(self._jetson.stats or {})
        s = TegraSample()
        if isinstance(stats.get("GPU"), (int, float)):
            s.gpu_pct = float(stats["GPU"])
        for key, value in stats.items():
            if key.startswith("Temp ") and isinstance(value, (int, float)) and value > -40:
                s.temps_c[key[5:].lower()] = float(value)
        if isinstance(stats.get("Power TOT"), (int, float)):
            s.rails_mw["VDD_IN"] = float(stats["Power TOT"])   # jtop's total: the board's power
        return s

    def close(self) -> None:
        self._jetson.close()


def _is_jetson() -> bool:
    return os.path.exists("/etc/nv_tegra_release") or shutil.which("tegrastats") is not None


def open_jetson_source(kind: str = "auto", interval_s: float = 1.0):
    """jtop, else tegrastats, else None (not a Jetson, or `kind` says none)."""
    if kind not in GPU_SOURCES:
        raise ValueError(f"GPU source must be one of {GPU_SOURCES}, got {kind!r}")
    if kind == "none" or (kind == "auto" and not _is_jetson()):
        return None
    if kind in ("auto", "jtop"):
        try:
            return JtopSource()
        except Exception as e:  # not installed, or its service is not running
            if kind == "jtop":
                raise
            log.info("jtop unavailable (%s): reading tegrastats instead", e)
    if shutil.which("tegrastats") is None:
        return None
    return TegrastatsReader(interval_s).start()


class SystemSampler:
    """Readings of this machine and process; `sample()` never blocks (CPU% is since the last call)."""

    def __init__(self, gpu: str = "auto", interval_s: float = 1.0, jetson=None):
        self._proc = psutil.Process()
        psutil.cpu_percent(None)                  # the first call only starts the measurement
        self._jetson = jetson if jetson is not None else open_jetson_source(gpu, interval_s)
        self.source = "psutil" + (f"+{'jtop' if isinstance(self._jetson, JtopSource) else 'tegrastats'}"
                                  if self._jetson is not None else "")

    def sample(self) -> SystemSample:
        vm = psutil.virtual_memory()
        out = SystemSample(rss_mb=self._proc.memory_info().rss / MB, mem_avail_mb=vm.available / MB,
                           mem_total_mb=vm.total / MB, cpu_pct=min(100.0, psutil.cpu_percent(None)),
                           temp_c=_hottest_sensor(), source=self.source)
        j = self._jetson.latest() if self._jetson is not None else None
        if j is not None:
            out.gpu_pct, out.power_w = j.gpu_pct, j.power_w
            out.temp_c = j.temp_c if j.temp_c is not None else out.temp_c
        return out

    def close(self) -> None:
        if self._jetson is not None:
            self._jetson.close()


def _hottest_sensor() -> Optional[float]:
    read = getattr(psutil, "sensors_temperatures", None)
    if read is None:
        return None
    try:
        temps = [t.current for ts in read().values() for t in ts if t.current is not None and t.current > -40]
    except (OSError, RuntimeError):
        return None
    return max(temps) if temps else None


def _clamp(v: Optional[float], hi: float, lo: float = 0.0) -> Optional[float]:
    return None if v is None else min(hi, max(lo, float(v)))


class TelemetryReporter:
    """Telemetry messages of one role: `report()` samples now; rates are since the last report."""

    def __init__(self, client: str, role: str, counters: Callable[[], dict],
                 sampler: Optional[SystemSampler] = None, interval: float = 0.0,
                 clock: Callable[[], float] = time.monotonic):
        self.client, self.role, self.counters = client, role, counters
        self.sampler = sampler or SystemSampler()
        self.interval, self.clock = interval, clock
        self._lock = threading.Lock()
        self._prev: Optional[tuple] = None        # (time, tokens, busy_s, wall_s)
        self._busy: Optional[float] = None        # kept while no time was accounted since

    def report(self) -> Telemetry:
        with self._lock:
            sysm = self.sampler.sample()
            c = self.counters() or {}
            now = self.clock()
            tokens = int(c.get("tokens", 0) or 0)
            busy_s, wall_s = c.get("busy_s"), c.get("wall_s")
            tok_s, busy = 0.0, c.get("busy")
            if self._prev is not None:
                t0, tok0, b0, w0 = self._prev
                if now > t0:
                    tok_s = max(0, tokens - tok0) / (now - t0)
                if busy_s is not None and b0 is not None:
                    busy = (busy_s - b0) / (wall_s - w0) if wall_s - w0 > 0 else self._busy
            elif busy_s is not None and wall_s:
                busy = busy_s / wall_s
            self._prev, self._busy = (now, tokens, busy_s, wall_s), busy
        drafted = c.get("drafted") or 0
        acceptance = c.get("accepted", 0) / drafted if drafted else None
        dropped = c.get("dropped", 0)
        dropped = sum(dropped.values()) if isinstance(dropped, dict) else int(dropped or 0)
        kv_used, kv_budget = c.get("kv_used_bytes"), c.get("kv_budget_bytes")
        power = sysm.power_w
        return Telemetry(
            client=self.client, role=self.role, time=time.time(), interval=float(self.interval),
            rss_mb=sysm.rss_mb, mem_avail_mb=sysm.mem_avail_mb, mem_total_mb=sysm.mem_total_mb,
            kv_used_mb=None if kv_used is None else kv_used / MB,
            kv_budget_mb=None if kv_budget is None else kv_budget / MB,
            cpu_pct=_clamp(sysm.cpu_pct, 100.0), gpu_pct=_clamp(sysm.gpu_pct, 100.0),
            temp_c=_clamp(sysm.temp_c, 1000.0, -273.0), power_w=_clamp(power, 1e6),
            tokens=tokens, tok_s=tok_s, tok_j=tok_s / power if power else None,
            sessions=int(c.get("sessions", 0) or 0), acceptance=_clamp(acceptance, 1.0),
            busy=_clamp(busy, 1.0), batch_mean=_clamp(c.get("batch_mean"), 1e6),
            batch_max=int(c.get("batch_max", 0) or 0), dropped=dropped, source=sysm.source)
