"""Where the fleet simulation's inputs come from, each with its source named.

* targets: a device profile's roofline for the reference target (Qwen2.5-Coder-1.5B Q4_K_M, the
  same constants as `edge-hub plan --profile`), or the emulated targets of a measured
  starsd_scaling run (its step, verify costs, network and acceptance);
* the draft's D(b): measured (a starsd_scaling run's micro-benchmarked or in-sweep batch times)
  or a hub profile's roofline over b sequences (weights read once, each session's KV read, the
  flops of b tokens, the per-call overhead), which is NOT a measurement;
* the broker: benchmarks/star/broker_costs.py's JSON (routed messages per broker CPU second).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Dict, Optional

from benchmarks.lib.fleet_des import FleetInputs
from devices.profile import load_profile
from server.planner import SystemInputs

TARGET_WEIGHTS, TARGET_PARAMS = 1_117_320_768, 1.54e9      # Qwen2.5-Coder-1.5B Q4_K_M (docs/models.md)
DRAFT_WEIGHTS, DRAFT_PARAMS = 491_400_064, 0.494e9          # Qwen2.5-Coder-0.5B Q4_K_M (docs/models.md)
DRAFT_KV_BYTES_PER_TOKEN = 2 * 24 * 2 * 64 * 2              # K and V, 24 layers, 2 KV heads x 64, fp16
DATA_ALPHA = 0.68                                           # docs/models.md: 0.5B vs 1.5B greedy agreement
ROOFLINE_BATCHES = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)


def target_costs(profile: str) -> dict:
    """One target step and the verify cost of k tokens (in steps) on a profile, its roofline."""
    p = load_profile(profile)
    return {"target_step_ms": p.call_ms(TARGET_WEIGHTS, TARGET_PARAMS, 1),
            "verify_cost": {k: p.verify_cost(k, TARGET_WEIGHTS, TARGET_PARAMS) for k in range(1, 10)},
            "source": f"{profile} profile roofline ({p.source}), Qwen2.5-Coder-1.5B Q4_K_M"}


def draft_roofline(profile: str, context: int = 512, max_context: int = 1536) -> dict:
    """A draft step over b sessions on a hub profile: the roofline, not a measurement."""
    p = load_profile(profile)
    bw = p.bandwidth_gbs * 1e9 * p.bandwidth_efficiency
    flops = p.fp16_tflops * 1e12 * p.compute_efficiency
    step = {}
    for b in ROOFLINE_BATCHES:
        mem_s = (DRAFT_WEIGHTS + b * context * DRAFT_KV_BYTES_PER_TOKEN) / bw
        step[b] = 1e3 * max(mem_s, 2.0 * DRAFT_PARAMS * b / flops) + p.call_overhead_ms
    mem = (p.gpu_memory_gb or p.usable_memory_gb) * 1e9
    return {"draft_step_ms": step, "max_sessions": int((mem - DRAFT_WEIGHTS) // (max_context * DRAFT_KV_BYTES_PER_TOKEN)),
            "source": f"{profile} profile roofline (NOT measured): Qwen2.5-Coder-0.5B, {context}-token "
                      f"contexts read per step, sessions up to {max_context} tokens in {mem / 1e9:.0f} GB"}


def draft_measured(scaling_json: Path, gamma: Optional[int] = None, in_sweep: bool = False) -> dict:
    """Per-step draft ms by batch from a starsd_scaling run: D(b) / γ (its micro-benchmark, or the
    batches the draft served during the sweep)."""
    d = json.loads(Path(scaling_json).read_text())
    g = gamma or d["config"]["gamma"]
    table = d["planner"]["inrun_service_ms"] if in_sweep else d["service_ms"]
    step = {int(b): float(ms) / g for b, ms in table.items()}
    top = max(step)
    for b in ROOFLINE_BATCHES:          # past what was measured: no more batching gain (the planner's
        if b > top:                     # linear extrapolation of a noisy tail can fall to zero)
            step[b] = step[top] * b / top
    return {"draft_step_ms": step,
            "max_sessions": 2 * max(d["config"]["ns"]) + 4,
            "source": f"measured: {'in-sweep' if in_sweep else 'micro-benchmarked'} D(b) of {scaling_json}"}


def broker_cost(broker_json: Path, broker: str = "mosquitto") -> dict:
    """ms of broker CPU per routed message, from broker_costs' best-loaded point of that broker."""
    d = json.loads(Path(broker_json).read_text())
    pts = [p for p in d["load"].get(broker, {}).get("points", []) if p.get("routed_msgs_per_broker_cpu_s")]
    if not pts:
        raise ValueError(f"{broker_json} has no {broker} load points")
    best = max(pts, key=lambda p: p["broker_cpu_share"])        # the busiest broker: least idle overhead
    return {"broker_msg_ms": 1e3 / best["routed_msgs_per_broker_cpu_s"],
            "capacity_msgs_per_s": best["routed_msgs_per_broker_cpu_s"],
            "observed_msgs_per_s": max(p["routed_msgs_per_s"] for p in pts),
            "source": f"{broker_json}: {broker}, {best['targets']} emulated targets, "
                      f"{best['broker_cpu_share']:.0%} of a core"}


def fleet_inputs(target: dict, draft: dict, alpha: float, gamma: int, net_ms: float, hub_net_ms: float,
                 broker_msg_ms: float, extra_ms: float = 0.0, feed_ms: float = 0.0) -> FleetInputs:
    """extra_ms: per-round cost outside the broker and the network (signing, the links' threads)."""
    vc: Dict[int, float] = {int(k): float(v) for k, v in target["verify_cost"].items()}
    sysi = SystemInputs(draft_step_ms={int(b): float(v) for b, v in draft["draft_step_ms"].items()},
                        draft_feed_ms=feed_ms, target_step_ms=float(target["target_step_ms"]),
                        verify_cost=vc, rtt_ms=extra_ms, alpha=alpha)
    return FleetInputs(system=sysi, gamma=gamma, net_ms=net_ms, hub_net_ms=hub_net_ms,
                       broker_msg_ms=broker_msg_ms, max_sessions=int(draft.get("max_sessions", 1 << 30)))
