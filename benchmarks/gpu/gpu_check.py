"""One prepared GPU check: the torch engine on CUDA with random weights of the real model shapes --
step, verify, prefill, the draft service's D(b), losslessness on the device (greedy and chi-square), the StarSD planner
for Jetson targets, and (optionally) llama.cpp's GGUF path.

    bash benchmarks/gpu/gpu_check.sh                       # on an NVIDIA machine, ~5-8 min
    .venv/bin/python -m benchmarks.gpu.gpu_check --accelerator cpu --quick --out /tmp/g   # the dry run here

Needs only what the repository carries and the machine's torch (no registry: the models are
random weights of SmolLM2-135M, Qwen2.5-Coder-0.5B and 1.5B shapes; timings do not depend on
weight values, acceptance comes from the CPU runs). Per model and dtype: step time at batch
1/4/16/64/256, a verify over k = 1..8 in units of one step, prefill tok/s; per draft model the
DraftService's D(b) up to b = 256; speculative greedy == plain greedy on the device per dtype,
and sampled speculation against the target's exact distribution (chi-square);
the planner (server/planner.py) fed with these for Orin Nano and AGX Orin targets: per-target
speedup and N_full. Writes $OUT/gpu_check.json (everything, rewritten after each section, so a
run cut short keeps what it measured) and $OUT/gpu_check.md. A time budget (--budget-s) skips
what would not fit and says so.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
import time
from pathlib import Path

DRAFTS = ("smollm2-135m", "qwen2.5-coder-0.5b")     # the draft service's D(b) is measured for these
PLANNER_DRAFT, PLANNER_TARGET = "qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b"
QUICK_DRAFT, QUICK_TARGET = "tiny-llama", "tiny-qwen2"


def args_of(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--accelerator", dest="device", choices=("cpu", "cuda"), default="cuda")
    ap.add_argument("--quick", action="store_true", help="small shapes and sizes: a dry run of every section")
    ap.add_argument("--out", default=os.environ.get("OUT") or None, help="output folder (default $OUT, else a temp dir)")
    ap.add_argument("--models", default=None, help="comma-separated (default: the three real shapes)")
    ap.add_argument("--dtypes", default=None, help="default: bfloat16,float16,float32 on cuda; float32 on cpu")
    ap.add_argument("--batches", default=None, help="default 1,4,16,64,256 (quick: 1,4,16)")
    ap.add_argument("--reps", type=int, default=None, help="timed repetitions per point (default 5, quick 2)")
    ap.add_argument("--gamma", type=int, default=4, help="drafts per request in the draft service's D(b)")
    ap.add_argument("--alpha", type=float, default=0.68, help="acceptance the planner assumes")
    ap.add_argument("--rtt-ms", type=float, default=5.0, help="round trip the planner assumes (measured here: ~5 ms)")
    ap.add_argument("--budget-s", type=float, default=None, help="stop starting new parts after this (default 420, quick 90)")
    ap.add_argument("--llama-sdist", default=None, help="a llama-cpp-python sdist to build with CUDA for the GGUF part")
    ap.add_argument("--no-gguf", action="store_true", help="skip the GGUF part")
    a = ap.parse_args(argv)
    cuda = a.device == "cuda"
    a.dtypes = (a.dtypes or ("bfloat16,float16,float32" if cuda else "float32")).split(",")
    a.batches = [int(b) for b in (a.batches or ("1,4,16" if a.quick else "1,4,16,64,256")).split(",")]
    a.reps = a.reps or (2 if a.quick else 5)
    a.budget_s = a.budget_s or (90.0 if a.quick else 420.0)
    a.context, a.prefill = (16, 64) if a.quick else (64, 512)
    a.ns = [1, 2, 4, 8, 16] if a.quick else [1, 2, 4, 8, 16, 32, 64, 128, 256]
    a.out = a.out or tempfile.mkdtemp(prefix="gpu-check-")
    return a


def machine(device: str) -> dict:
    import torch
    cpu = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                if ln.startswith("model name")), platform.processor()) if Path("/proc/cpuinfo").exists() else ""
    info = {"torch": torch.__version__, "cuda": torch.version.cuda, "cpu": f"{cpu} ({os.cpu_count()} cpus)",
            "python": platform.python_version(), "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "device_name": torch.cuda.get_device_name(0) if device == "cuda" else "CPU"}
    if device == "cuda":
        info["gpu_memory_gb"] = torch.cuda.get_device_properties(0).total_memory / 2**30
    return info


class Budget:
    """Parts start only while the time budget lasts; what is left out is listed."""

    def __init__(self, seconds: float):
        self.t0, self.seconds, self.skipped = time.monotonic(), seconds, []

    def left(self) -> float:
        return self.seconds - (time.monotonic() - self.t0)

    def allows(self, what: str) -> bool:
        if self.left() > 0:
            return True
        self.skipped.append(what)
        print(f"  budget spent: {what} not run", flush=True)
        return False


def measure_models(a, shapes: dict, res: dict, budget: Budget, save) -> None:
    """Step / verify / prefill per model and dtype, and the draft service's D(b) for the drafts."""
    import torch

    from benchmarks.gpu import _measure as m
    drafts = (QUICK_DRAFT,) if a.quick else DRAFTS
    for dtype in a.dtypes:
        for name, cfg in shapes.items():
            key = f"{name}/{dtype}"
            if not budget.allows(f"{key}: step, verify, prefill"):
                continue
            t = time.monotonic()
            eng = m.build_engine(cfg, a.device, dtype, max_len=a.prefill + 256)
            steps = m.step_times(eng, a.batches, a.context, a.reps)
            ver = m.verify_times(eng, range(1, 9), a.context, a.reps)
            res["models"][key] = {
                "params": sum(p.numel() for p in eng.model.parameters()), "step_ms": steps, "verify_ms": ver,
                "verify_cost": {k: v / ver[1] for k, v in ver.items()},
                "prefill_tokens": a.prefill, "prefill_tok_s": m.prefill_tok_s(eng, a.prefill, a.reps)}
            print(f"{key}: step ms {steps}, verify k=8 {ver[8] / ver[1]:.2f} steps, "
                  f"prefill {res['models'][key]['prefill_tok_s']:.0f} tok/s ({time.monotonic() - t:.0f} s)", flush=True)
            if name in drafts and budget.allows(f"{key}: the draft service's D(b)"):
                svc = m.draft_service_times(eng, a.batches, a.gamma, a.context, a.reps)
                res["draft_service"][key] = {"gamma": a.gamma, "service_ms": svc}
                print(f"{key}: draft service D(b) ms {svc}", flush=True)
            del eng
            if a.device == "cuda":
                torch.cuda.empty_cache()
            save()


def run(a) -> dict:
    from benchmarks.gpu import _measure as m
    from benchmarks.gpu._gguf import gguf_section
    from benchmarks.gpu._report import planner_section
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    budget = Budget(a.budget_s)
    shapes = m.QUICK_SHAPES if a.quick else {k: m.SHAPES[k] for k in (a.models.split(",") if a.models else m.SHAPES)}
    res = {"args": dict(vars(a)), "machine": machine(a.device), "models": {},
           "draft_service": {}, "lossless": {}, "planner": {}, "gguf": {}, "skipped": budget.skipped, "wall_s": 0.0}

    def save():
        res["wall_s"] = time.monotonic() - budget.t0
        (out / "gpu_check.json").write_text(json.dumps(res, indent=1, default=str))

    print(f"GPU check on {res['machine']['device_name']} -> {out}", flush=True)
    measure_models(a, shapes, res, budget, save)
    for dtype in a.dtypes:            # a tiny pair: greedy always; the sampled chi-square while time lasts
        res["lossless"][dtype] = m.greedy_lossless(a.device, dtype)
        if budget.allows(f"{dtype}: the chi-square losslessness test"):
            res["lossless"][dtype]["chi2"] = m.chi2_lossless(a.device, dtype, n=1500 if a.quick else 3000)
        print(f"lossless {dtype}: {res['lossless'][dtype]}", flush=True)
        save()
    draft, target = (QUICK_DRAFT, QUICK_TARGET) if a.quick else (PLANNER_DRAFT, PLANNER_TARGET)
    res["planner"] = planner_section(res, draft, target, a.alpha, a.rtt_ms, a.ns)
    save()
    if a.no_gguf:
        res["gguf"] = {"skipped": "skipped: --no-gguf"}
    elif budget.allows("the GGUF path"):
        gshapes = shapes if a.quick else {k: shapes[k] for k in ("smollm2-135m", "qwen2.5-coder-1.5b") if k in shapes}
        res["gguf"] = gguf_section(a.device, gshapes, out / "gguf-work", a.llama_sdist, max(60.0, budget.left()),
                                   a.context, a.prefill, a.reps)
    else:
        res["gguf"] = {"skipped": "skipped: the time budget was spent"}
    save()
    return res


def main(argv=None) -> None:
    a = args_of(argv)
    if a.device == "cuda":
        import torch
        if not torch.cuda.is_available():
            raise SystemExit("torch sees no CUDA device here: run on an NVIDIA machine, or dry-run with "
                             "--accelerator cpu --quick")
    res = run(a)
    from benchmarks.gpu._report import markdown
    md = markdown(res)
    (Path(a.out) / "gpu_check.md").write_text(md)
    print(md)
    print(f"wrote {a.out}/gpu_check.json and {a.out}/gpu_check.md")

if __name__ == "__main__":
    main()
