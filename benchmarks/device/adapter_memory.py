"""How many SUN specialists fit a device as full copies vs as LoRA adapters, and what a llama.cpp
prefill worker with N adapters really holds (issue 37 point 4).

    .venv/bin/python -m benchmarks.device.adapter_memory            # table + measured RSS (~2 min)
    .venv/bin/python -m benchmarks.device.adapter_memory --table-only

Table: for each device profile and model (the GGUFs in models/, read by edge/memory/model_shape.py),
the budget less one llama.cpp prefill worker's plan (edge-agent plan --role prefill: base, KV of
1024 x 8, compute, runtime) is what specialists may take; a full copy costs the prefill module's
weights again, an adapter rank x (in + out) per linear (all seven) per layer x 4 bytes (F32, what
edge-export adapter writes by default; F16 halves it). The shared decoder is not counted here.

Measured: peak RSS (os.wait4, that child only) of benchmarks/lib/adapter_rss_worker.py with 0, 1, 8
and 64 GGUF LoRA adapters of rank 8 and 16 loaded over the real SmolLM2-135M GGUF, beside the plan.
The adapters are written by export/gguf_lora.py from a PEFT adapter with random A and B (values do
not change memory); each worker loads N copies, one file per task. Writes
benchmarks/results/adapter_memory/<variant>.{json,md,png}.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks.lib.results import ROOT, result_stem
from edge.memory.adapters import TARGETS, adapter_bytes, specialists_that_fit
from edge.memory.model_shape import read_shape
from edge.memory.fit import Workload, estimate

MODELS = {"SmolLM2-135M": "SmolLM2-135M-Instruct.Q4_1.gguf",
          "Qwen2.5-Coder-0.5B": "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
          "Qwen2.5-Coder-1.5B": "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"}
PROFILES = ("jetson-orin-nano-8gb", "cpu-2core")
RANKS = (8, 16, 64)
MEASURE_RANKS = (8, 16)
MEASURE_COUNTS = (0, 1, 8, 64)
GB, MB = 1e9, 1e6


def _worker_plan(shape, n: int = 0, one: int = 0):
    return estimate(shape, Workload("prefill", "llamacpp", 1024, 8, adapters=n, adapter_bytes=n * one))


def table() -> list:
    from devices.profile import load_profile
    rows = []
    for prof in PROFILES:
        budget = int(load_profile(prof).usable_memory_gb * GB)
        for label, fname in MODELS.items():
            shape = read_shape(str(ROOT / "models" / fname))
            e = _worker_plan(shape)
            row = {"profile": prof, "model": label, "quant": shape.quant, "budget_bytes": budget,
                   "worker_bytes": e.total, "full_copy_bytes": e.parts["weights"], "ranks": {}}
            for r in RANKS:
                sp = specialists_that_fit(budget - e.total, e.parts["weights"], adapter_bytes(shape, r, TARGETS, 4))
                row["left_bytes"], row["full_copies"] = sp.left_bytes, sp.full_copies
                row["ranks"][r] = {"adapter_bytes": sp.adapter_bytes, "adapters": sp.adapters}
            rows.append(row)
    return rows


def _write_adapter(rank: int, tmp: Path) -> Path:
    """One GGUF LoRA of `rank` over SmolLM2's seven linears, random A and B."""
    import torch
    from edge.model.lora.adapter import init_adapter
    from edge.model.lora.files import save_adapter
    from edge.model.transformer import ModelConfig
    from export.gguf_lora import export_adapter
    s = read_shape(str(ROOT / "models" / MODELS["SmolLM2-135M"]))
    cfg = ModelConfig(vocab_size=s.vocab, hidden_size=s.hidden, intermediate_size=s.intermediate,
                      num_layers=s.layers, num_heads=s.heads, num_kv_heads=s.kv_heads, head_dim=s.head_dim)
    ad = init_adapter(cfg, rank, seed=rank)
    torch.manual_seed(rank)
    for b in ad.lora_b.values():
        b.normal_(std=0.01)
    d = save_adapter(tmp / f"peft-r{rank}", ad)
    return export_adapter(d, ROOT / "models" / MODELS["SmolLM2-135M"], tmp / f"r{rank}.gguf", log=lambda m: None)


def _peak(argv) -> tuple:
    with tempfile.TemporaryFile() as out:
        p = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT,
                             env=dict(os.environ, PYTHONPATH=str(ROOT)))
        _, status, ru = os.wait4(p.pid, 0)
        out.seek(0)
        text = out.read().decode(errors="replace")
    res = next((json.loads(x[7:]) for x in text.splitlines() if x.startswith("RESULT ")), None)
    if os.waitstatus_to_exitcode(status) != 0 or res is None:
        raise RuntimeError(f"worker failed: {' '.join(map(str, argv[3:5]))} ...\n{text[-1500:]}")
    return ru.ru_maxrss * 1024, res


def measure() -> list:
    base = str(ROOT / "models" / MODELS["SmolLM2-135M"])
    shape = read_shape(base)
    out = []
    with tempfile.TemporaryDirectory(prefix="adapter-rss-") as t:
        tmp = Path(t)
        for rank in MEASURE_RANKS:
            one = _write_adapter(rank, tmp)
            copies = [one] + [shutil.copy(one, tmp / f"r{rank}-{i}.gguf") for i in range(1, max(MEASURE_COUNTS))]
            for n in MEASURE_COUNTS:
                peak, res = _peak([sys.executable, "-m", "benchmarks.lib.adapter_rss_worker", base,
                                   *map(str, copies[:n])])
                plan = _worker_plan(shape, n, adapter_bytes(shape, rank, TARGETS, 4)).total
                out.append({"rank": rank, "adapters": n, "peak_rss_bytes": peak, "plan_bytes": plan,
                            "adapter_file_bytes": one.stat().st_size, "switches": res["switches"]})
                print(f"rank {rank} x {n}: peak {peak / MB:.0f} MB, plan {plan / MB:.0f} MB", flush=True)
            for c in copies:
                Path(c).unlink()
    return out


def markdown(rows: list, measured: list) -> str:
    lines = ["# Specialists that fit: full copies vs prefill-only LoRA adapters", "",
             "Budget: the profile's usable memory less one llama.cpp prefill worker (base once, KV 1024 x 8, "
             "compute, runtime; `edge-agent plan --role prefill`). A full copy = the prefill module's GGUF "
             "weights again; an adapter = rank x (in + out) x 4 B (F32) over all seven linears of every layer "
             "(F16 halves it). The shared decoder is not counted. Arithmetic from edge/memory/, not measured.", "",
             "| profile | model | left for specialists | full copy | full copies | "
             + " | ".join(f"rank {r}: adapter | rank {r}: adapters" for r in RANKS) + " |",
             "|---|---|---|---|---|" + "---|---|" * len(RANKS)]
    for r in rows:
        cells = " | ".join(f"{r['ranks'][k]['adapter_bytes'] / MB:.1f} MB | {r['ranks'][k]['adapters']}" for k in RANKS)
        lines.append(f"| {r['profile']} | {r['model']} ({r['quant']}) | {r['left_bytes'] / GB:.2f} GB | "
                     f"{r['full_copy_bytes'] / MB:.0f} MB | {r['full_copies']} | {cells} |")
    if measured:
        lines += ["", "## Measured: peak RSS of a llama.cpp prefill worker with N adapters (SmolLM2-135M Q4_1)", "",
                  "One process each (benchmarks/lib/adapter_rss_worker.py), peak RSS from os.wait4; it loads N "
                  "GGUF LoRA files (F32, all seven linears) and prefills 64 tokens under up to 8 of them.", "",
                  "| rank | adapters | adapter file | peak RSS | plan | peak - peak(0) | N x adapter bytes |",
                  "|---|---|---|---|---|---|---|"]
        zero = {m["rank"]: m["peak_rss_bytes"] for m in measured if m["adapters"] == 0}
        for m in measured:
            one = m["adapter_file_bytes"]
            lines.append(f"| {m['rank']} | {m['adapters']} | {one / MB:.2f} MB | {m['peak_rss_bytes'] / MB:.0f} MB | "
                         f"{m['plan_bytes'] / MB:.0f} MB | {(m['peak_rss_bytes'] - zero[m['rank']]) / MB:.0f} MB | "
                         f"{m['adapters'] * one / MB:.0f} MB |")
    return "\n".join(lines) + "\n"


def plot(rows: list, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(10, 4.5))
    labels = [f"{r['profile']}\n{r['model']}" for r in rows]
    width = 0.2
    for i, (name, key) in enumerate([("full copies", None)] + [(f"adapters r{k}", k) for k in RANKS]):
        vals = [max(1, r["full_copies"] if key is None else r["ranks"][key]["adapters"]) for r in rows]
        ax.bar([x + (i - 1.5) * width for x in range(len(rows))], vals, width, label=name)
    ax.set_yscale("log")
    ax.set_xticks(range(len(rows)), labels, fontsize=7)
    ax.set_ylabel("specialists that fit (log)")
    ax.set_title("Specialists beside one llama.cpp prefill worker: full copies vs LoRA adapters (F32)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--table-only", action="store_true", help="arithmetic only, no measured RSS")
    ap.add_argument("--out", default=None, help="stem to write (default benchmarks/results/adapter_memory/default)")
    a = ap.parse_args(argv)
    rows = table()
    measured = [] if a.table_only else measure()
    stem = Path(a.out) if a.out else result_stem("adapter_memory")
    stem.parent.mkdir(parents=True, exist_ok=True)
    stem.with_suffix(".json").write_text(json.dumps({"table": rows, "measured": measured}, indent=1))
    stem.with_suffix(".md").write_text(markdown(rows, measured))
    plot(rows, stem.with_suffix(".png"))
    print(stem.with_suffix(".md").read_text())


if __name__ == "__main__":
    main()
