"""The simulator against a measured small star: a starsd_scaling run fed back with its own costs.

benchmarks/star/starsd_scaling.py measured one real draft service (the real hub, Mosquitto,
HMAC, target loop) feeding N emulated targets; its JSON records the costs it ran with: the
emulated device's step and verify costs, the network it emulated, the acceptance, the draft's
D(b) (micro-benchmarked before the sweep, and the batches it served during it) and the protocol
overhead measured at N = 1. The simulator gets exactly those, per N, and its per-target tok/s and
round time sit beside the measured ones.
"""
from __future__ import annotations

import json
from pathlib import Path

from benchmarks.lib.fleet_des import simulate
from benchmarks.lib.fleet_inputs import draft_measured, fleet_inputs


def run_inputs(run: dict) -> dict:
    """The target and cost figures a starsd_scaling JSON recorded."""
    tm = run["timing"]
    over = (run.get("overhead") or {}).get(run["config"]["broker"], {}).get("overhead_median_ms") or 0.0
    return {"target": {"target_step_ms": tm["target_step_ms"], "verify_cost": tm["verify_cost"]},
            "alpha": run["alpha"]["alpha"], "gamma": run["config"]["gamma"],
            "net_ms": tm["net_rtt_ms"] / 2, "overhead_ms": over}


def validate(path: Path, broker_msg_ms: float, seconds: float = 60.0, seed: int = 0) -> dict:
    """Per measured N: measured vs simulated per-target tok/s and round time, both D(b) sources."""
    run = json.loads(Path(path).read_text())
    ri = run_inputs(run)
    rows = []
    for p in sorted(run["points"], key=lambda p: p["n"]):
        row = {"n": p["n"], "measured_tps": p["per_target_tps_mean"], "measured_round_ms": p.get("iteration_ms"),
               "measured_busy": p.get("busy_ratio"), "measured_batch": p.get("mean_batch"),
               "measured_speedup": p["per_target_tps_mean"] / run["baselines"]["alone"]["system_tps"]}
        for label, in_sweep in (("bench", False), ("sweep", True)):
            draft = draft_measured(Path(path), ri["gamma"], in_sweep)
            # the N = 1 overhead holds the broker's two hops: charge the rest as the round's extra
            inp = fleet_inputs(ri["target"], draft, ri["alpha"], ri["gamma"], ri["net_ms"], 0.0, broker_msg_ms,
                               extra_ms=max(0.0, ri["overhead_ms"] - 2 * broker_msg_ms))
            # the measured runs draw accepted drafts from a low-discrepancy sequence of the same mean
            # at every N: the simulator commits that mean each round (random draws over ~100 rounds
            # at N = 1 would move it by ~5%)
            f = simulate(inp, p["n"], 1, 1, warmup_ms=10 * 1e3, window_ms=seconds * 1e3, seed=seed,
                         deterministic=True)
            row[f"sim_{label}_tps"] = f.per_target_tps
            row[f"sim_{label}_round_ms"] = f.round_ms
            row[f"sim_{label}_busy"] = f.draft_busy
            row[f"sim_{label}_batch"] = f.mean_batch
            row[f"err_{label}_tps"] = f.per_target_tps / row["measured_tps"] - 1
            if row["measured_round_ms"]:
                row[f"err_{label}_round"] = f.round_ms / row["measured_round_ms"] - 1
        rows.append(row)
    return {"file": str(path), "label": run["timing"].get("label") or run["config"]["profile"],
            "inputs": ri, "machine": run.get("machine", {}), "rows": rows}
