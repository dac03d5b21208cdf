"""Device profiles: memory, bandwidth, compute and backends of a class of device.

A profile feeds three things: the planner (how long a target's step and a
verify call over k tokens take on that device), the StarSD benchmark's
emulated remote targets, and provisioning (which onnxruntime package, which
Python). Figures are public spec-sheet numbers unless `source` says measured.
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
