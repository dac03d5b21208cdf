"""One benchmark per device: what fits its profile, measured on it, in one report named after it.

  python -m benchmarks.device.device --profile cpu-2core                   # here: ~10 min on 2 cores
  python -m benchmarks.device.device --profile jetson-orin-nano-8gb --broker mqtts://hub.local:8883 --tls-dir certs

On the device (the same script here now, on a Jetson later) it

1. plans each candidate role against the profile's usable memory (edge-agent plan's arithmetic)
   and runs only what fits;
2. measures each fitting model on the profile's first backend: decode tok/s at batch 1 / 4 / 16,
   the bandwidth bound (read bandwidth measured now / bytes read per token), the cost of one
   verify call over k tokens in one-token units, peak RSS (benchmarks/engines/backends.py, a fresh
   process per model);
3. StarSD: this device's target with a remote draft vs the target alone, same prompts, texts
   compared (benchmarks/star/starsd_two_device.py: with --broker against that hub's draft service; without,
   cores as devices -- the target on core 0, hub + draft on core 1 -- when there are two cores);
4. SUN: the shared decoder's step with int4 (Q4_0) weights vs F16, same runtime
   (benchmarks/sun/qsun_speed.py's timing).

Run from the repository root. Writes benchmarks/results/device/<profile>.{json,md,png} (--out). Each
part that cannot run says why in the report instead of failing the rest.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

from benchmarks.lib.results import ROOT, result_stem

GB = 1e9
# (role, model) candidates, largest first; the profile's budget decides which run
CANDIDATES = [("target", "qwen2.5-coder-1.5b"), ("draft", "qwen2.5-coder-0.5b"), ("decoder", "smollm2-135m")]
CONFIG_OF_BACKEND = {"llamacpp": "llamacpp:orig", "onnx": "onnx:int4", "torch": "torch:fp32"}


def plan(profile, max_len: int) -> list:
    """Each candidate against the profile's usable memory, as `edge-agent plan` computes it."""
    from edge.model.fetch import model_path
    from edge.cli.plan_command import make_plan
    from edge.model.resolved import resolve
    budget = int(profile.usable_memory_gb * GB)
    # the profile's first backend family ("llamacpp-cuda" is llama.cpp; the accelerator is the build's)
    backend = next((b.split("-")[0] for b in profile.backends if b.split("-")[0] in CONFIG_OF_BACKEND), "torch")
    rows = []
    for role, model in CANDIDATES:
        row = {"role": role, "model": model, "backend": backend}
        if not model_path(model).exists():
            rows.append({**row, "fits": False, "why": "not fetched (make models)"})
            continue
        try:
            f, e = make_plan(role, resolve(model, backend, role), budget, max_len, max_batch=16, max_sessions=16)
        except Exception as exc:  # a model the planner cannot size is reported, not fatal
            rows.append({**row, "fits": False, "why": str(exc)[:200]})
            continue
        rows.append({**row, "fits": f.fits, "needs_gb": e.total / GB, "budget_gb": budget / GB,
                     "max_context": f.max_context, "max_sequences": f.max_sequences,
                     "why": "" if f.fits else "does not fit the profile's usable memory"})
    return rows


def backend_speed(rows: list, threads: int, steps: int, work: Path) -> dict:
    """benchmarks/engines/backends.py's measurement of each fitting model, one fresh process each."""
    from benchmarks.engines import backends
    out = {"read_bandwidth_gbs": backends.bandwidth_gbs(threads), "models": []}
    a = SimpleNamespace(work=str(work), threads=threads, steps=steps)
    seen = set()
    for r in rows:
        if not r["fits"] or r["model"] in seen:
            continue
        seen.add(r["model"])
        config = CONFIG_OF_BACKEND[r["backend"]]
        entry = {"model": r["model"], "config": config}
        try:
            res = backends.run_one(r["model"], config, a)
            path = backends.artifact(r["model"], config, work)
            bpt = backends.bytes_per_token(r["model"], config, path)
            entry.update({"tok_s": {b: res["batch"][b]["total_tok_s"] for b in backends.BATCHES},
                          "verify_cost": {k: res["verify_s"][k] / res["verify_s"][1] for k in backends.KS},
                          "bytes_per_token": bpt, "bound_tok_s": out["read_bandwidth_gbs"] * 1e9 / bpt,
                          "peak_rss_mb": res["peak_rss_mb"]})
        except Exception as exc:
            entry["error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
        out["models"].append(entry)
        print(f"backend {entry}", flush=True)
    return out


def starsd(rows: list, a) -> dict:
    """Target with a remote draft vs the target alone (benchmarks/star/starsd_two_device.py)."""
    fits = {r["role"]: r for r in rows if r["fits"]}
    if "target" not in fits or (not a.hub and "draft" not in fits):
        return {"skipped": "the target (and, without --broker, the draft) must fit the profile"}
    if not a.hub and len(os.sched_getaffinity(0)) < 2:
        return {"skipped": "one core and no --broker: there is no second device for the draft"}
    with tempfile.TemporaryDirectory() as d:
        cmd = [sys.executable, "-m", "benchmarks.star.starsd_two_device", "--target", fits["target"]["model"],
               "--mtbench", str(a.prompts), "--code", str(a.prompts), "--new", str(a.new), "--rounds", str(a.rounds),
               "--gammas", a.gammas, "--out", str(Path(d) / "starsd")]
        if "draft" in fits:
            cmd += ["--draft", fits["draft"]["model"]]
        if a.hub:
            cmd += ["--broker", a.hub] + (["--tls-dir", a.tls_dir] if a.tls_dir else [])
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=3600, cwd=ROOT)
        if p.returncode != 0:
            return {"error": (p.stderr or p.stdout).strip().splitlines()[-1][:300] if (p.stderr or p.stdout)
                    else f"exit {p.returncode}"}
        return json.loads((Path(d) / "starsd.json").read_text())


def sun_decoder(rows: list, threads: int, prompt_len: int = 128, steps: int = 32, repeats: int = 5) -> dict:
    """The shared decoder's step, int4 (Q4_0) vs F16 weights on llama.cpp (benchmarks/sun/qsun_speed.py)."""
    dec = next((r for r in rows if r["role"] == "decoder" and r["fits"]), None)
    if dec is None:
        return {"skipped": "no shared decoder fits the profile"}
    from benchmarks.sun.qsun_speed import step_times
    from edge.model.fetch import model_path
    from export.gguf import export_gguf
    res = {"model": dec["model"], "step_s": {}}
    with tempfile.TemporaryDirectory() as d:
        files = {ft: export_gguf(model_path(dec["model"]), Path(d) / f"{ft}.gguf", ftype=ft) for ft in ("F16", "Q4_0")}
        for _ in range(2):                     # interleaved: a load spike hits both formats
            for ft, f in files.items():
                res["step_s"].setdefault(ft, []).append(step_times(f, threads, prompt_len, steps, repeats))
    med = {ft: statistics.median(v) for ft, v in res["step_s"].items()}
    res.update({"median_step_s": med, "speedup_q4_vs_f16": med["F16"] / med["Q4_0"]})
    return res


def markdown(rep: dict) -> str:
    p = rep["profile"]
    lines = [f"# Device report: {p['name']}", "",
             f"Host: {rep['host']['cpu']} ({rep['host']['cores']} cores), {rep['time']}, load average "
             f"{rep['host']['load_avg'][0]:.2f} at the start. Profile: {p['kind']}, {p['usable_memory_gb']} GB usable "
             f"of {p['memory_gb']} GB, backends {', '.join(p['backends'])}.", "",
             "## What fits (edge-agent plan, the profile's usable memory)", "",
             "| role | model | backend | needs GB | fits | largest context | largest sequences |", "|---|---|---|---:|---|---:|---:|"]
    for r in rep["plan"]:
        need = f"{r['needs_gb']:.2f}" if "needs_gb" in r else "-"
        lines.append(f"| {r['role']} | {r['model']} | {r['backend']} | {need} | {'yes' if r['fits'] else 'no: ' + r['why']} "
                     f"| {r.get('max_context', '-')} | {r.get('max_sequences', '-')} |")
    b = rep["backends"]
    lines += ["", f"## Backend speed (read bandwidth measured now: {b['read_bandwidth_gbs']:.1f} GB/s)", "",
              "| model | config | b1 tok/s | bound tok/s | % bound | b4 total | b16 total | verify k=2,4,8 (× k=1) | peak RSS MB |",
              "|---|---|---:|---:|---:|---:|---:|---|---:|"]
    for m in b["models"]:
        if "error" in m:
            lines.append(f"| {m['model']} | {m['config']} | failed: {m['error'][:80]} | | | | | | |")
            continue
        t, v = m["tok_s"], m["verify_cost"]
        lines.append(f"| {m['model']} | {m['config']} | {t[1]:.1f} | {m['bound_tok_s']:.0f} | "
                     f"{100 * t[1] / m['bound_tok_s']:.0f}% | {t[4]:.1f} | {t[16]:.1f} | "
                     f"{', '.join(f'{v[k]:.2f}' for k in (2, 4, 8))} | {m['peak_rss_mb']:.0f} |")
    s = rep["starsd"]
    lines += ["", "## StarSD: this device's target with a remote draft vs the target alone", ""]
    if "rows" in s:
        gs = [k[len("median_speedup_"):] for k in s if k.startswith("median_speedup_")]
        lines += [f"{s['setup']}; {s['new_tokens']} greedy tokens, medians of {s['rounds']}.", "",
                  "| set | alone tok/s | " + " | ".join(f"{g} tok/s | × | accept | same text" for g in gs) + " |",
                  "|---|---:|" + "---:|---:|---:|---|" * len(gs)]
        for r in s["rows"]:
            cells = [r["kind"], f"{r['alone_tok_s']:.2f}"]
            for g in gs:
                x = r[g]
                cells += [f"{x['tok_s']:.2f}", f"{x['speedup']:.2f}", f"{x['acceptance']:.2f}",
                          "yes" if x["same_text"] else f"split at {x['split_at']}"]
            lines.append("| " + " | ".join(cells) + " |")
        lines += [""] + [f"Median speedup {g}: **{s['median_speedup_' + g]:.2f}×**" for g in gs]
    else:
        lines.append(f"Not run: {s.get('skipped') or s.get('error')}")
    u = rep["sun"]
    lines += ["", "## SUN shared decoder step: int4 (Q4_0) vs F16, llama.cpp", ""]
    if "median_step_s" in u:
        m = u["median_step_s"]
        lines += [f"{u['model']}: F16 {1e3 * m['F16']:.1f} ms, Q4_0 {1e3 * m['Q4_0']:.1f} ms per step: "
                  f"**{u['speedup_q4_vs_f16']:.2f}×** (medians, two interleaved rounds)."]
    else:
        lines.append(f"Not run: {u.get('skipped') or u.get('error')}")
    return "\n".join(lines) + "\n"


def plot(rep: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(1, 3, figsize=(14, 4))
    for m in rep["backends"]["models"]:
        if "tok_s" in m:
            ax[0].plot(list(m["tok_s"]), list(m["tok_s"].values()), marker="o", label=m["model"])
            ax[1].plot(list(m["verify_cost"]), list(m["verify_cost"].values()), marker="o", label=m["model"])
    ax[0].set(xscale="log", xlabel="batch", ylabel="total tok/s", title="decode")
    ax[1].plot([1, 8], [1, 1], "k:", label="memory-bound ideal")
    ax[1].set(xlabel="tokens per verify call (k)", ylabel="cost / one-token call", title="verify cost")
    s = rep["starsd"]
    if "rows" in s:
        gs = [k[len("median_speedup_"):] for k in s if k.startswith("median_speedup_")]
        xs = range(len(s["rows"]))
        ax[2].bar([x - 0.2 for x in xs], [r["alone_tok_s"] for r in s["rows"]], 0.4, label="target alone")
        for g in gs[:1]:
            ax[2].bar([x + 0.2 for x in xs], [r[g]["tok_s"] for r in s["rows"]], 0.4, label=f"StarSD {g}")
        ax[2].set_xticks(list(xs), [r["kind"][:4] + str(i) for i, r in enumerate(s["rows"])])
    ax[2].set(ylabel="tok/s", title="StarSD vs target alone")
    for x in ax:
        x.legend(fontsize=7)
    fig.suptitle(f"device report: {rep['profile']['name']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--profile", required=True, help="a devices/profiles name or a TOML path")
    ap.add_argument("--broker", default=None, metavar="mqtt[s]://HOST:PORT",
                    help="measure StarSD against this hub's draft service (default: cores as devices here)")
    ap.add_argument("--tls-dir", default=None, help="with an mqtts:// --broker: the CA and this device's certificate")
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    ap.add_argument("--steps", type=int, default=12, help="timed steps per batch size")
    ap.add_argument("--prompts", type=int, default=2, help="StarSD: MT-bench first turns and code prompts each")
    ap.add_argument("--new", type=int, default=64, help="StarSD: greedy tokens per prompt")
    ap.add_argument("--rounds", type=int, default=2, help="StarSD: repeats per prompt and mode (medians)")
    ap.add_argument("--gammas", default="3,auto", help="StarSD: γ values (integers or auto)")
    ap.add_argument("--max-len", type=int, default=4096, help="context the memory plan sizes")
    ap.add_argument("--skip", default="", help="comma-separated parts not to run: backends,starsd,sun")
    ap.add_argument("--work", default=str(ROOT / "artifacts" / "backends"))
    ap.add_argument("--out", default=None, help="report path without suffix (default benchmarks/results/device/<profile>)")
    a = ap.parse_args(argv)
    from edge.telemetry.cpu_info import cpu_name
    from devices.profile import load_profile
    prof = load_profile(a.profile)
    skip = set(filter(None, a.skip.split(",")))
    rep = {"profile": {k: getattr(prof, k) for k in ("name", "kind", "memory_gb", "usable_memory_gb", "backends")},
           "host": {"cpu": cpu_name(), "cores": len(os.sched_getaffinity(0)), "machine": platform.machine(),
                    "load_avg": os.getloadavg()}, "time": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    rep["plan"] = plan(prof, a.max_len)
    print(json.dumps(rep["plan"], indent=1), flush=True)
    none = {"read_bandwidth_gbs": 0.0, "models": []}
    rep["backends"] = none if "backends" in skip else backend_speed(rep["plan"], a.threads, a.steps, Path(a.work))
    rep["starsd"] = {"skipped": "--skip"} if "starsd" in skip else starsd(rep["plan"], a)
    rep["sun"] = {"skipped": "--skip"} if "sun" in skip else sun_decoder(rep["plan"], a.threads)
    out = Path(a.out) if a.out else result_stem("device", prof.name)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(rep, indent=1, default=str))
    md = markdown(rep)
    out.with_suffix(".md").write_text(md)
    plot(rep, out.with_suffix(".png"))
    print(md)


if __name__ == "__main__":
    main()
