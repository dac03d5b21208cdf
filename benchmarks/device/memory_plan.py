"""Is the memory planner right? Peak RSS of real child processes next to edge/memory/fit.py's estimate.

    .venv/bin/python -m benchmarks.device.memory_plan              # measure every case (~15 min on 2 cores)
    .venv/bin/python -m benchmarks.device.memory_plan --only llamacpp
    .venv/bin/python -m benchmarks.device.memory_plan --estimate-only   # re-estimate the stored measurements

Each case runs in its own process (benchmarks/lib/memory_workload.py, or `edge-agent run` itself)
and its peak RSS is what os.wait4 reports for that one child (ru_maxrss), so no other process
on the machine is counted. Run from the repository root. Writes
benchmarks/results/memory_plan/<variant>.{json,md,png} (--out; default: the variant `default`). The planner's
calibrated constants were fitted to these cases: keep them when changing the constants, and
re-run when a backend changes. Memory, not time: nothing here is timed.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.lib.results import ROOT, result_stem
from edge.telemetry.cpu_info import cpu_name

SMOL, Q05, Q15 = "smollm2-135m", "qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b"
ONNX_FP32 = "/tmp/starsun-memplan/smol-fp32"   # made by --export (edge-export bundle)
ONNX_INT4 = "/tmp/starsun-memplan/smol-int4"


def _c(backend, model, role, context, sequences=1, **kw):
    return {"backend": backend, "model": model, "role": role, "context": context, "sequences": sequences, **kw}


CASES = [
    # llama.cpp: KV is n_ctx x n_seq_max up front, so a short fill shows the same KV as a full one
    _c("llamacpp", SMOL, "target", 512), _c("llamacpp", SMOL, "target", 8192, fill=1024),
    _c("llamacpp", Q05, "target", 4096, fill=1024), _c("llamacpp", Q05, "target", 32768, fill=512),
    _c("llamacpp", Q15, "target", 1000, fill=900), _c("llamacpp", Q15, "target", 4096, fill=1024),
    _c("llamacpp", Q15, "target", 16384, fill=512),
    # --repack on: a K-quant's weights repacked for the CPU (read, not mapped: one copy resident)
    _c("llamacpp", Q05, "target", 4096, fill=1024, repack="on"),
    _c("llamacpp", Q15, "target", 4096, fill=1024, repack="on"),
    # --repack both: the repacked copy beside the mapped file, and the twin's one sequence of KV
    _c("llamacpp", Q15, "target", 4096, fill=1024, repack="both"),
    _c("llamacpp", Q05, "draft", 4096, 8, fill=256), _c("llamacpp", SMOL, "draft", 2048, 4, fill=256),
    _c("llamacpp", Q05, "decoder", 1024, 16, fill=128), _c("llamacpp", SMOL, "decoder", 1024, 64, fill=64),
    _c("llamacpp", Q05, "prefill", 1024, 8, fill=900),
    # torch (dequantised weights in the torch dtype; KV grows with the tokens held)
    _c("torch", SMOL, "target", 1024), _c("torch", SMOL, "target", 4096),
    _c("torch", SMOL, "target", 2048, dtype="bfloat16"),
    _c("torch", SMOL, "draft", 1024, 8), _c("torch", SMOL, "decoder", 512, 32),
    _c("torch", Q05, "target", 512), _c("torch", Q05, "target", 2048),
    _c("torch", SMOL, "prefill", 2048),
    # onnxruntime (exported SmolLM2; fp32 KV kept as numpy)
    _c("onnx", ONNX_FP32, "target", 1024), _c("onnx", ONNX_FP32, "target", 2048),
    _c("onnx", ONNX_INT4, "target", 1024), _c("onnx", ONNX_INT4, "target", 4096),
    _c("onnx", ONNX_INT4, "draft", 1024, 8), _c("onnx", ONNX_INT4, "decoder", 512, 16),
    _c("onnx", ONNX_INT4, "prefill", 2048),
    # the agent itself, and llama-cpp-python's own Llama on the same files (the runtime's footprint)
    _c("llamacpp", Q15, "target", 4096, kind="cli"), _c("llamacpp", Q15, "llama", 4096),
    _c("llamacpp", Q05, "target", 4096, kind="cli"), _c("llamacpp", Q05, "llama", 4096),
    _c("llamacpp", SMOL, "target", 2048, kind="cli"), _c("llamacpp", SMOL, "llama", 2048),
]


# onnxruntime's peak varies from run to run (fp32 SmolLM2, ctx 1024: 1403 to 1653 MiB measured here,
# the same case and code): its cases run three times and the worst counts
REPEATS = {"onnx": 3}


def case_id(c: dict) -> str:
    extra = "".join(f" {k}={c[k]}" for k in ("dtype", "fill", "kind", "repack") if k in c)
    return f"{c['backend']} {Path(str(c['model'])).name} {c['role']} ctx={c['context']} seq={c['sequences']}{extra}"


def _spawn_peak(argv, env=None) -> tuple:
    """(peak RSS bytes of that one child, its stdout+stderr text, exit status)."""
    with tempfile.TemporaryFile() as out:
        p = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
        _, status, ru = os.wait4(p.pid, 0)
        p.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        return ru.ru_maxrss * 1024, out.read().decode(errors="replace"), p.returncode


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _cli_argv(c: dict, port: int) -> list:
    return [str(ROOT / ".venv/bin/edge-agent"), "run", "--role", "target", "-b", c["backend"], "-m", c["model"],
            "--broker", f"mqtt://127.0.0.1:{port}", "--max-len", str(c["context"]), "--prompt",
            "Write a Python function that checks whether a number is prime.", "-n", "16"]


def measure(c: dict) -> dict:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    if c.get("kind") != "cli":
        peak, text, rc = _spawn_peak([sys.executable, "-m", "benchmarks.lib.memory_workload", json.dumps(c)], env)
        res = next((json.loads(line[7:]) for line in text.splitlines() if line.startswith("RESULT ")), None)
        return {"peak_rss_bytes": peak, "rc": rc, "child": res, "tail": None if res else text[-800:]}
    port = _free_port()
    with tempfile.NamedTemporaryFile("w", suffix=".conf", delete=False) as conf:
        conf.write(f"listener {port} 127.0.0.1\nallow_anonymous true\nset_tcp_nodelay true\n")
    broker = subprocess.Popen(["mosquitto", "-c", conf.name], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        time.sleep(0.5)
        peak, text, rc = _spawn_peak(_cli_argv(c, port), env)
    finally:
        broker.terminate()
        broker.wait()
        os.unlink(conf.name)
    return {"peak_rss_bytes": peak, "rc": rc, "child": None, "tail": text[-800:] if rc else None}


def estimate_for(c: dict):
    from edge.memory.fit import Workload, estimate
    from edge.memory.model_shape import read_shape
    if c["role"] == "llama":
        return None
    shape = read_shape(c["model"], role=c["role"], backend=c["backend"])
    return estimate(shape, Workload(c["role"], c["backend"], c["context"], c["sequences"],
                                    dtype=c.get("dtype", "float32"), twin=c.get("repack") == "both"))


def export_onnx() -> None:
    """The SmolLM2 ONNX bundles the onnx cases load (fp32 and int4), made once."""
    for out, flags in ((ONNX_FP32, []), (ONNX_INT4, ["--int4", "--no-fp32"])):
        if not (Path(out) / "manifest.json").is_file():
            subprocess.run([str(ROOT / ".venv/bin/edge-export"), "bundle", SMOL, out, "--onnx", "model",
                            "--gguf", "", *flags], check=True, cwd=ROOT)


def rows(results: list) -> list:
    out = []
    for r in results:
        est = estimate_for(r["case"])
        meas = r["peak_rss_bytes"]
        row = {**r, "case_key": case_id(r["case"]), "estimate": est.to_dict() if est else None}
        if est and meas and r["rc"] == 0:
            row["error_pct"] = 100.0 * (est.total - meas) / meas
        out.append(row)
    return out


def write(rs: list, out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps({"host": socket.gethostname(), "cpu": cpu_name(),
                                                    "cases": rs}, indent=1))
    mib = 1 / 2 ** 20
    lines = ["# Memory plan: estimate vs measured peak RSS (benchmarks/device/memory_plan.py)", "",
             f"Peak RSS of one child process per case (os.wait4 ru_maxrss), 2-core x86 ({cpu_name()}), no GPU. "
             "Estimate: edge/memory/fit.py (runtime + tokenizer + weights + KV + compute [+ loading]).", "",
             "Measured: the worst of the case's runs (onnxruntime cases: 3 runs, all listed).", "",
             "| case | measured MiB | estimate MiB | error | weights | KV | compute | torch imported | runs MiB |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rs:
        e = r["estimate"]
        p = e["parts_bytes"] if e else {}
        ti = (r["child"] or {}).get("torch_imported", "-") if r["case"].get("kind") != "cli" else "-"
        lines.append(f"| {r['case_key']} | {r['peak_rss_bytes'] * mib:.0f} | "
                     f"{e['total_bytes'] * mib if e else float('nan'):.0f} | "
                     f"{r['error_pct']:+.1f}% | " if "error_pct" in r else
                     f"| {r['case_key']} | {r['peak_rss_bytes'] * mib:.0f} | - | - | ")
        runs = " / ".join(f"{x * mib:.0f}" for x in r.get("peaks_bytes", [r["peak_rss_bytes"]]))
        if e:
            lines[-1] += (f"{p['weights'] * mib:.0f} | {p['kv'] * mib:.0f} | {p['compute'] * mib:.0f} | {ti} "
                          f"| {runs} |")
        else:
            lines[-1] += f"- | - | - | {ti} | {runs} |"
    lines += ["", "The agent against the runtime: `edge-agent run --role target -b llamacpp` (kind=cli) vs "
              "llama-cpp-python's own `Llama(path, n_ctx)` on the same file (role llama):", "",
              "| model | context | edge-agent run MiB | Llama MiB | difference |", "|---|---|---|---|---|"]
    by = {(r["case"]["model"], r["case"]["context"], r["case"].get("kind") == "cli" or r["case"]["role"]): r
          for r in rs if r["rc"] == 0}
    for (model, ctx, k), r in sorted(by.items(), key=lambda x: str(x[0])):
        own = by.get((model, ctx, "llama"))
        if k is True and own:
            a, b = r["peak_rss_bytes"] * mib, own["peak_rss_bytes"] * mib
            lines.append(f"| {model} | {ctx} | {a:.0f} | {b:.0f} | {a - b:+.0f} MiB ({100 * (a - b) / b:+.1f}%) |")
    errs = [abs(r["error_pct"]) for r in rs if "error_pct" in r]
    if errs:
        lines += ["", f"{len(errs)} estimated cases: mean |error| {sum(errs) / len(errs):.1f}%, "
                      f"max {max(errs):.1f}%."]
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    _plot(rs, out.with_suffix(".png"))


def _plot(rs: list, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    pts = [(r["peak_rss_bytes"] / 2 ** 30, r["estimate"]["total_bytes"] / 2 ** 30, r["case"]["backend"])
           for r in rs if r.get("estimate") and "error_pct" in r]
    fig, ax = plt.subplots(figsize=(6, 6))
    for b, col in (("llamacpp", "tab:blue"), ("torch", "tab:red"), ("onnx", "tab:green")):
        xs = [m for m, _, bb in pts if bb == b]
        ax.scatter(xs, [e for _, e, bb in pts if bb == b], label=b, color=col)
    top = max([max(m, e) for m, e, _ in pts] + [1.0]) * 1.05
    ax.plot([0, top], [0, top], "k-", lw=0.8, label="estimate = measured")
    ax.plot([0, top], [0, top * 1.15], "k:", lw=0.6, label="±15%")
    ax.plot([0, top], [0, top * 0.85], "k:", lw=0.6)
    ax.set_xlabel("measured peak RSS (GiB)")
    ax.set_ylabel("planner estimate (GiB)")
    ax.set_title("edge/memory/fit.py vs measured, one process per case")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default=None, help="run the cases whose id contains one of these (comma list)")
    ap.add_argument("--estimate-only", action="store_true", help="re-estimate the stored measurements")
    ap.add_argument("--out", type=Path, default=result_stem("memory_plan"),
                    help="results path without suffix (its .json holds the stored measurements)")
    a = ap.parse_args()
    stored = a.out.with_suffix(".json")
    old = {r["case_key"]: r for r in json.loads(stored.read_text())["cases"]} if stored.is_file() else {}
    if a.estimate_only:
        write(rows([v for k, v in old.items() if k in {case_id(c) for c in CASES}]), a.out)
        return
    wanted = [x for x in (a.only or "").split(",") if x]

    def picked(c):
        return not wanted or any(x in case_id(c) for x in wanted)
    if any(c["backend"] == "onnx" for c in CASES if picked(c)):
        export_onnx()
    keys = {case_id(c) for c in CASES}
    results = {k: v for k, v in old.items() if k in keys}      # cases no longer listed are dropped
    for c in CASES:
        key = case_id(c)
        if not picked(c):
            continue
        runs = [measure(c) for _ in range(REPEATS.get(c["backend"], 1))]
        m = max(runs, key=lambda r: r["peak_rss_bytes"])          # the plan must cover the worst run
        m["peaks_bytes"] = [r["peak_rss_bytes"] for r in runs]
        print(f"{key}: {', '.join(f'{p / 2 ** 20:.0f}' for p in m['peaks_bytes'])} MiB rc={m['rc']}", flush=True)
        results[key] = {"case_key": key, "case": c, **m}
        write(rows(list(results.values())), a.out)   # after every case: a long run keeps what it measured


if __name__ == "__main__":
    main()
