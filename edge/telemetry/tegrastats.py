"""Jetson readings from `tegrastats`: a pure line parser and a reader that runs the tool.

Used when jetson-stats' jtop is not installed (edge/telemetry/readings.py picks the source). One
tegrastats line looks like (Orin Nano, JetPack 6)

    RAM 3452/7620MB (lfb 25x4MB) SWAP 1518/16384MB (cached 174MB) CPU [1%@1420,2%@1420,off,...]
    GR3D_FREQ 0% cpu@50.031C ... tj@50.25C VDD_IN 4824mW/4824mW VDD_CPU_GPU_CV 518mW/518mW ...

Fields differ between boards and releases (AGX Orin has no input rail and prints
inst/avg/max; JetPack 7 adds a cur/max to temperatures and GR3D_FREQ X%@[F,F]; old boards
print rails without mW), so every field is optional and the parser never raises on a line
it half understands. The board's power is its input rail (VDD_IN, or POM_5V_IN on the
original Nano) when it has one, else the sum of its rails (AGX Orin, AGX Xavier).
"""
from __future__ import annotations

import logging
import re
import subprocess
import threading
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence

log = logging.getLogger(__name__)

_RAM = re.compile(r"\bRAM (\d+)/(\d+)MB")
_SWAP = re.compile(r"\bSWAP (\d+)/(\d+)MB")
_CPU = re.compile(r"\bCPU \[([^\]]*)\]")
_GPU = re.compile(r"\bGR3D_FREQ (\d+)%")
_TEMP = re.compile(r"\b([A-Za-z][\w]*)@(-?\d+(?:\.\d+)?)C")
_RAIL_MW = re.compile(r"\b([A-Z][A-Z0-9_]*) (\d+)mW(?:/\d+mW)*")
_RAIL_BARE = re.compile(r"\b([A-Z][A-Z0-9_]*) (\d+)/(\d+)(?=\s|$)")     # pre-JetPack 5: no unit
INPUT_RAILS = ("VDD_IN", "POM_5V_IN")     # rails that measure the whole board's input
MIN_VALID_C = -40.0                       # a powered-down sensor reads -256C: not a temperature


@dataclass
class TegraSample:
    ram_used_mb: Optional[float] = None
    ram_total_mb: Optional[float] = None
    swap_used_mb: Optional[float] = None
    cpu_loads: List[Optional[float]] = field(default_factory=list)   # per core; None = off
    gpu_pct: Optional[float] = None
    temps_c: Dict[str, float] = field(default_factory=dict)
    rails_mw: Dict[str, float] = field(default_factory=dict)          # instantaneous

    @property
    def cpu_pct(self) -> Optional[float]:
        """Mean load of the cores that are on."""
        on = [x for x in self.cpu_loads if x is not None]
        return sum(on) / len(on) if on else None

    @property
    def temp_c(self) -> Optional[float]:
        return max(self.temps_c.values()) if self.temps_c else None

    @property
    def power_w(self) -> Optional[float]:
        for rail in INPUT_RAILS:
            if rail in self.rails_mw:
                return self.rails_mw[rail] / 1000.0
        return sum(self.rails_mw.values()) / 1000.0 if self.rails_mw else None


def parse_line(line: str) -> TegraSample:
    """Every field tegrastats printed on this line that we know; the others stay None/empty."""
    s = TegraSample()
    if m := _RAM.search(line):
        s.ram_used_mb, s.ram_total_mb = float(m.group(1)), float(m.group(2))
    if m := _SWAP.search(line):
        s.swap_used_mb = float(m.group(1))
    if m := _CPU.search(line):
        for core in m.group(1).split(","):
            core = core.strip()
            load = re.match(r"(\d+)%", core)
            s.cpu_loads.append(float(load.group(1)) if load else None)   # "off": powered down
    if m := _GPU.search(line):
        s.gpu_pct = float(m.group(1))
    for name, value in _TEMP.findall(line):
        if float(value) >= MIN_VALID_C:
            s.temps_c[name.lower()] = float(value)
    for name, mw in _RAIL_MW.findall(line):
        s.rails_mw[name] = float(mw)
    for name, cur, _avg in _RAIL_BARE.findall(line):
        s.rails_mw.setdefault(name, float(cur))
    return s


class TegrastatsReader:
    """Runs `tegrastats --interval MS` and keeps the latest parsed line (`latest()`).

    `command` replaces the program (tests replay recorded lines through a stand-in, since
    no Jetson is at hand). A tool that exits or prints nothing leaves `latest()` None."""

    def __init__(self, interval_s: float = 1.0, command: Sequence[str] = ("tegrastats",)):
        self.interval_s = interval_s
        self.command = list(command) + ["--interval", str(max(1, int(interval_s * 1000)))]
        self._latest: Optional[TegraSample] = None
        self._lock = threading.Lock()
        self._proc: Optional[subprocess.Popen] = None
        self._thread: Optional[threading.Thread] = None
        self.lines = 0

    def start(self) -> "TegrastatsReader":
        self._proc = subprocess.Popen(self.command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                      stdin=subprocess.DEVNULL, text=True, errors="replace")
        self._thread = threading.Thread(target=self._read, name="tegrastats", daemon=True)
        self._thread.start()
        return self

    def _read(self) -> None:
        assert self._proc is not None and self._proc.stdout is not None
        for line in self._proc.stdout:
            sample = parse_line(line)
            with self._lock:
                self._latest = sample
                self.lines += 1
        log.debug("tegrastats ended (rc %s)", self._proc.poll())

    def latest(self) -> Optional[TegraSample]:
        with self._lock:
            return self._latest

    def close(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(5)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        if self._thread is not None:
            self._thread.join(5)
