"""The StarSD planner fed with benchmarks.gpu.gpu_check's measurements, and the markdown report.

The draft service runs on the measured device (its D(b) per step from the service timing); the
targets are Jetson profiles (devices/profiles: roofline step and verify cost of the reference
Qwen2.5-Coder-1.5B Q4_K_M, as `edge-hub plan --profile` takes them) and, for comparison, the
1.5B shape measured on this device itself (a GPU hub's own target).
"""
from __future__ import annotations

from typing import Dict, List, Optional

from devices.profile import load_profile
from server.planner import SystemInputs, n_full, standalone, sweep

TARGET_PROFILES = ("jetson-orin-nano-8gb", "jetson-agx-orin-32gb")
REFERENCE_TARGET = (1_117_320_768, 1.54e9)     # Qwen2.5-Coder-1.5B Q4_K_M: bytes, parameters


def profile_target(name: str) -> dict:
    p = load_profile(name)
    wb, params = REFERENCE_TARGET
    return {"target_step_ms": p.call_ms(wb, params, 1),
            "verify_cost": {k: p.verify_cost(k, wb, params) for k in range(1, 10)},
            "source": f"devices/profiles/{name}.toml roofline (Qwen2.5-Coder-1.5B Q4_K_M)"}


def measured_target(model: dict) -> dict:
    return {"target_step_ms": model["step_ms"][1], "verify_cost": model["verify_cost"],
            "source": "the 1.5B shape measured on this device (TorchEngine)"}


def plan_for(service_ms: Dict[int, float], gamma: int, target: dict, alpha: float, rtt_ms: float,
             ns: List[int]) -> dict:
    """Best γ per N, per-target speedup over decoding alone, N_full."""
    inp = SystemInputs(draft_step_ms={b: ms / gamma for b, ms in service_ms.items()}, draft_feed_ms=0.0,
                       target_step_ms=target["target_step_ms"], verify_cost=target["verify_cost"],
                       rtt_ms=rtt_ms, alpha=alpha)
    preds = sweep(inp, ns, range(1, 9))
    alone = standalone(inp, 1).per_target_tps
    rows = [{"n": p.n, "gamma": p.gamma, "system_tok_s": p.system_tps, "per_target_tok_s": p.per_target_tps,
             "speedup": p.per_target_tps / alone, "draft_busy": p.busy_ratio, "mean_batch": p.mean_batch}
            for p in preds]
    return {"target": target["source"], "target_step_ms": target["target_step_ms"], "standalone_tok_s": alone,
            "n_full": n_full(preds), "speedup_n1": rows[0]["speedup"], "rows": rows}


def planner_section(results: dict, draft: str, target_model: Optional[str], alpha: float, rtt_ms: float,
                    ns: List[int]) -> dict:
    """Per draft dtype x target: the planner's prediction."""
    out = {"alpha": alpha, "rtt_ms": rtt_ms, "draft": draft,
           "alpha_source": "assumed: Qwen2.5-Coder-0.5B -> 1.5B acceptance measured on CPU here "
                           "(benchmarks/results/starsd_scaling/pinned.json); random weights accept nothing",
           "plans": []}
    for key, svc in results["draft_service"].items():
        if not key.startswith(draft + "/"):
            continue
        dtype = key.split("/", 1)[1]
        targets = {name: profile_target(name) for name in TARGET_PROFILES}
        measured = results["models"].get(f"{target_model}/{dtype}") if target_model else None
        if measured:
            targets["this device"] = measured_target(measured)
        for name, target in targets.items():
            plan = plan_for(svc["service_ms"], svc["gamma"], target, alpha, rtt_ms, ns)
            out["plans"].append({"draft_dtype": dtype, "target_name": name, **plan})
    return out


def gguf_lines(g: dict) -> List[str]:
    if "skipped" in g:
        return [g["skipped"]]
    lines = [f"{g['runtime']}, GPU layers: {g['gpu_layers']}", "",
             "| model | step ms (batch 1) | verify k=1..8 (steps) | prefill tok/s |", "|---|---|---|---|"]
    for key, r in g["models"].items():
        ver = " ".join(f"{r['verify_cost'][k]:.2f}" for k in sorted(r["verify_cost"]))
        lines.append(f"| {key} | {r['step_ms']:.2f} | {ver} | {r['prefill_tok_s']:.0f} |")
    return lines


def markdown(res: dict) -> str:
    m = res["machine"]
    lines = [f"# GPU check: {m['device_name']} ({res['args']['device']})", "",
             f"torch {m['torch']}, CUDA {m.get('cuda')}, {m['cpu']}; {m['when']}; run took {res['wall_s']:.0f} s.",
             "Random weights of the real shapes (timings do not depend on weight values); medians.", ""]
    if res["args"]["quick"]:
        lines += ["**--quick: small shapes, a dry run of the code paths, not a measurement of any model.**", ""]
    lines += ["## Step, verify, prefill (TorchEngine)", "",
              "| model / dtype | step ms at batch " + " / ".join(map(str, res["args"]["batches"])) +
              " | verify k=1..8 (steps) | prefill tok/s |", "|---|---|---|---|"]
    for key, r in res["models"].items():
        steps = " / ".join(f"{r['step_ms'][b]:.2f}" for b in res["args"]["batches"])
        ver = " ".join(f"{r['verify_cost'][k]:.2f}" for k in sorted(r["verify_cost"]))
        lines.append(f"| {key} | {steps} | {ver} | {r['prefill_tok_s']:.0f} |")
    lines += ["", "## The draft service's D(b): one DraftService step over b requests", ""]
    for key, r in res["draft_service"].items():
        lines.append(f"* {key}, γ={r['gamma']}: " + ", ".join(f"b={b}: {ms:.1f} ms"
                                                            for b, ms in r["service_ms"].items()))
    lines += ["", "## Losslessness on this device (speculative greedy == plain greedy; sampled: chi-square)", ""]
    for dtype, r in res["lossless"].items():
        gaps = ", ".join(f"prompt {d['prompt']} at token {d['at']} (plain's logit gap {d['plain_logit_gap']})"
                         for d in r["differences"])
        lines.append(f"* {dtype}: {r['identical']}/{r['prompts']} identical, acceptance {r['acceptance']:.2f}: "
                     f"{r['verdict']}" + (f"; {gaps}" if gaps else ""))
        c = r.get("chi2")
        if c:
            lines.append(f"  * sampled (T=1, {c['n']} runs, {c['vocab'] ** c['length']} sequences): chi-square "
                         f"{c['chi2']:.1f} vs {c['critical']:.1f} at df {c['df']}: {'PASS' if c['passed'] else 'FAIL'}")
    p = res["planner"]
    lines += ["", f"## StarSD planner (draft {p['draft']} here; α={p['alpha']}, RTT {p['rtt_ms']} ms)", "",
              f"α: {p['alpha_source']}.", "",
              "| draft dtype | target | target step ms | N_full | speedup at N=1 | speedup at N_full | γ at N_full |",
              "|---|---|---|---|---|---|---|"]
    for pl in p["plans"]:
        at = next(r for r in pl["rows"] if r["n"] == pl["n_full"])
        lines.append(f"| {pl['draft_dtype']} | {pl['target_name']} | {pl['target_step_ms']:.1f} | {pl['n_full']} | "
                     f"{pl['speedup_n1']:.2f}x | {at['speedup']:.2f}x | {at['gamma']} |")
    lines += ["", "## GGUF path (llama.cpp)", ""] + gguf_lines(res["gguf"])
    if res["skipped"]:
        lines += ["", "## Not run (the time budget)", ""] + [f"* {s}" for s in res["skipped"]]
    return "\n".join(lines) + "\n"
