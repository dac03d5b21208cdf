"""Device profiles: memory, bandwidth, compute and backends of a class of device.

A profile feeds four things: the StarSD planner (how long a target's step and a
verify call over k tokens take on that device), the StarSD benchmark's
emulated remote targets, the memory planner's budget (`edge-agent plan
--profile`, `run --profile`: usable memory), and provisioning (which
onnxruntime package, which Python, where the wheels come from).

Every figure carries its source in `sources` (keyed by field name); a figure
measured on this workplace's machine says "measured here". `tok_s` lists
public decode rates of real models on the device: the points the roofline
(`call_ms`: bandwidth x efficiency + call overhead) is calibrated to, checked
by `tok_s_fit()` and tests/test_devices.py. This module imports nothing from
server/ or export/, so edge/ may read profiles.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List

if sys.version_info >= (3, 11):
    import tomllib
else:  # Jetson images ship Python 3.10
    import tomli as tomllib

PROFILE_DIR = Path(__file__).resolve().parent / "profiles"


@dataclass(frozen=True)
class DeviceProfile:
    name: str
    kind: str
    memory_gb: float
    usable_memory_gb: float
    bandwidth_gbs: float
    bandwidth_efficiency: float
    fp16_tflops: float
    compute_efficiency: float
    call_overhead_ms: float
    backends: List[str]
    python: str
    onnxruntime_package: str
    source: str
    verify_cost_table: Dict[int, float] = field(default_factory=dict)
    power_mode: str = ""                                        # the mode these figures are for
    ort_providers: List[str] = field(default_factory=list)      # onnxruntime, in order of preference
    software: Dict[str, str] = field(default_factory=dict)      # jetpack, l4t, cuda, python, os
    wheels: Dict[str, str] = field(default_factory=dict)        # package -> where its wheel comes from
    power_modes: Dict[str, dict] = field(default_factory=dict)  # name -> {watts, bandwidth_gbs, ...}
    sources: Dict[str, str] = field(default_factory=dict)       # field -> where the figure comes from
    tok_s: List[dict] = field(default_factory=list)             # {model, backend, weight_bytes, params, tok_s, source}
    unified_memory: bool = False        # Jetson: the GPU shares usable_memory_gb with the CPU
    gpu_memory_gb: float = 0.0          # a discrete GPU's usable memory (0: none, or unified)
    host_memory_gb: float = 0.0         # a discrete GPU's host: usable RAM (0: not said, not checked)

    def tok_s_fit(self) -> List[dict]:
        """Each public tok/s point next to the roofline's, with the ratio (roofline / public)."""
        out = []
        for pt in self.tok_s:
            model_tok_s = 1e3 / self.call_ms(float(pt["weight_bytes"]), float(pt["params"]), 1)
            out.append({**pt, "roofline_tok_s": model_tok_s, "ratio": model_tok_s / float(pt["tok_s"])})
        return out

    def call_ms(self, weight_bytes: float, params: float, k: int = 1) -> float:
        """Roofline time of one forward call over k tokens (weights read once)."""
        mem_s = weight_bytes / (self.bandwidth_gbs * 1e9 * self.bandwidth_efficiency)
        flop_s = 2.0 * params * k / (self.fp16_tflops * 1e12 * self.compute_efficiency)
        return 1e3 * max(mem_s, flop_s) + self.call_overhead_ms

    def verify_cost(self, k: int, weight_bytes: float, params: float) -> float:
        """Cost of one call over k tokens in single-step units (measured table first)."""
        if k in self.verify_cost_table:
            return self.verify_cost_table[k]
        if self.verify_cost_table:  # interpolate between measured points
            ks = sorted(self.verify_cost_table)
            lo = max([x for x in ks if x <= k], default=ks[0])
            hi = min([x for x in ks if x >= k], default=ks[-1])
            if lo == hi:
                return self.verify_cost_table[lo] * k / lo
            a, b = self.verify_cost_table[lo], self.verify_cost_table[hi]
            return a + (b - a) * (k - lo) / (hi - lo)
        return self.call_ms(weight_bytes, params, k) / self.call_ms(weight_bytes, params, 1)

    def fits(self, needed_bytes: float) -> bool:
        return needed_bytes <= self.usable_memory_gb * 1e9


def load_profile(name_or_path: str) -> DeviceProfile:
    p = Path(name_or_path)
    if not p.exists():
        p = PROFILE_DIR / f"{name_or_path}.toml"
    if not p.exists():
        raise ValueError(f"unknown device profile {name_or_path!r}; known: {', '.join(list_profiles())}")
    with open(p, "rb") as f:
        d = tomllib.load(f)
    table = {int(k): float(v) for k, v in d.pop("verify_cost", {}).items()}
    return DeviceProfile(verify_cost_table=table, **d)


def list_profiles() -> List[str]:
    return sorted(p.stem for p in PROFILE_DIR.glob("*.toml"))
