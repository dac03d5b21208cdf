"""benchmarks/engines/backends.py's report: the markdown table, the int4-vs-fp ratios, the plot, the JSON."""
from __future__ import annotations

import json
import os
import platform
from pathlib import Path

import numpy as np

BATCHES = (1, 4, 16)
KS = (1, 2, 4, 8)


def write_results(rows: list, meta: dict, out: Path) -> str:
    """JSON + markdown + plot of one run; returns the markdown."""
    bw = meta["read_bandwidth_gbs"]
    for row in rows:
        if "bytes_per_token" in row:
            row["bound_tok_s"] = bw * 1e9 / row["bytes_per_token"]
    rat = ratios(rows)
    out.with_suffix(".json").write_text(json.dumps({"meta": meta, "rows": rows, "int4_vs_fp": rat}, indent=1))
    md = table(rows, bw) + "\n\nStep speed of lower precisions vs fp in the same runtime:\n\n"
    md += "| model | backend | precision | vs | batch | speedup |\n|---|---|---|---|---|---|\n"
    md += "\n".join(f"| {r['model']} | {r['backend']} | {r['precision']} | {r['vs']} | {r['batch']} | "
                    f"{r['speedup']:.2f}x |" for r in rat)
    md += f"\n\nMachine: {meta['machine']}, {meta['cpus']} cpus, load average at the end {meta['load_avg']}.\n"
    if meta.get("bandwidth_note"):
        md += f"{meta['bandwidth_note']}\n"
    out.with_suffix(".md").write_text(md)
    if rows:
        plot(rows, out.with_suffix(".png"))
    return md


# --- report ---------------------------------------------------------------------------------------

def table(rows: list, bw: float) -> str:
    head = ("| model | backend | precision | artifact MB | read/token MB | bound tok/s | b1 tok/s | % bound "
            "| b4 total | b16 total | verify k=2,4,8 (x k=1) | peak RSS MB |")
    lines = [f"Memory read bandwidth (numpy sums on all threads): {bw:.1f} GB/s", "", head, "|" + "---|" * 12]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['model']} | {r['backend']} | {r['precision']} | failed: {r['error'][:80]} |"
                         + " |" * 8)
            continue
        b = r["batch"]
        v = r["verify_s"]
        ver = ", ".join(f"{v[k] / v[1]:.2f}" for k in KS[1:])
        lines.append(
            f"| {r['model']} | {r['backend']} | {r['precision']} | {r['artifact_bytes'] / 1e6:.0f} | "
            f"{r['bytes_per_token'] / 1e6:.0f} | {r['bound_tok_s']:.0f} | {b[1]['total_tok_s']:.1f} | "
            f"{100 * b[1]['total_tok_s'] / r['bound_tok_s']:.0f}% | {b[4]['total_tok_s']:.1f} | "
            f"{b[16]['total_tok_s']:.1f} | {ver} | {r['peak_rss_mb']:.0f} |")
    return "\n".join(lines)


def ratios(rows: list) -> list:
    """int4 vs fp step speed in the same runtime (the issue's goal: >= 1.45x)."""
    out = []
    by = {(r["model"], r["backend"], r["precision"]): r for r in rows if "error" not in r}
    for (m, b, p), r in by.items():
        fp = by.get((m, b, "fp32")) or by.get((m, b, "f16"))
        if fp is None or p in ("fp32", "f16"):
            continue
        for B in BATCHES:
            out.append({"model": m, "backend": b, "precision": p, "vs": fp["precision"], "batch": B,
                        "speedup": fp["batch"][B]["step_s"] / r["batch"][B]["step_s"]})
    return out


def plot(rows: list, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    ok = [r for r in rows if "error" not in r]
    fig, ax = plt.subplots(1, 3, figsize=(17, 5))
    labels = [f"{r['model'][:12]}\n{r['backend']}:{r['precision']}" for r in ok]
    x = np.arange(len(ok))
    ax[0].bar(x, [r["batch"][1]["total_tok_s"] for r in ok], label="measured")
    ax[0].scatter(x, [r["bound_tok_s"] for r in ok], color="red", marker="_", s=400, label="bandwidth bound")
    ax[0].set_xticks(x, labels, rotation=70, fontsize=7)
    ax[0].set_ylabel("tokens/s, batch 1")
    ax[0].set_yscale("log")
    ax[0].legend()
    for r in ok:
        ax[1].plot(BATCHES, [r["batch"][B]["total_tok_s"] for B in BATCHES], marker="o",
                   label=f"{r['backend']}:{r['precision']}")
        ax[2].plot(KS, [r["verify_s"][k] / r["verify_s"][1] for k in KS], marker="o",
                   label=f"{r['backend']}:{r['precision']}")
    ax[1].set_xlabel("batch")
    ax[1].set_ylabel("total tokens/s")
    ax[1].set_xscale("log", base=2)
    ax[2].plot(KS, [1] * len(KS), "k:", label="memory-bound ideal")
    ax[2].set_xlabel("tokens per verify call (k)")
    ax[2].set_ylabel("cost / one-token call")
    ax[1].legend(fontsize=6)
    ax[2].legend(fontsize=6)
    fig.suptitle(f"backends x precisions ({platform.node()}, {os.cpu_count()} cpus)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
