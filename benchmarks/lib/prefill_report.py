"""benchmarks/engines/prefill_speed.py's report: the .md tables and the .png from its JSON."""
from __future__ import annotations

import json
import statistics
from pathlib import Path


def _med(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def _f(x, nd=1):
    return "-" if x is None else f"{x:.{nd}f}"


def _load(samples) -> str:
    loads = [s["load1"] for s in samples if "load1" in s]
    return f"{min(loads):.1f}-{max(loads):.1f}" if loads else "-"


def cell_rows(cell: dict) -> list:
    """(label, median wall tok/s, median CPU tok/s, the server's own prompt tok/s, load range, requests)
    per server."""
    out = []
    for label, samples in cell["samples"].items():
        out.append((label, _med([s["tok_s"] for s in samples]), _med([s["cpu_tok_s"] for s in samples]),
                    _med([s.get("server_prompt_per_second") for s in samples]), _load(samples), len(samples)))
    return out


def _ratio(x, ref) -> str:
    return _f(x / ref, 2) + "×" if x and ref else ""


def _prefill_table(data: dict) -> list:
    lines = ["| model | threads | server | prompt tok/s (wall) | vs llama-server | the server's own prompt tok/s "
             "| prompt tok/s per CPU s | vs llama-server (CPU) | vs llama-server --no-repack (CPU) | requests "
             "| load avg | commit |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for key, cell in data["cells"].items():
        if "samples" not in cell:
            continue
        rows = cell_rows(cell)
        ref = next((r for r in rows if r[0] == "llama-server"), None) or \
            next((r for r in rows if r[0].startswith("llama-server")), None)
        same = next((r for r in rows if r[0] == "llama-server --no-repack"), None)
        for label, wall, cpu, own, load, n in rows:
            ratio = _ratio(wall, ref[1]) if ref and label != ref[0] else ""
            cratio = _ratio(cpu, ref[2]) if ref and label != ref[0] else ""
            sratio = _ratio(cpu, same[2]) if same and label != same[0] else ""
            lines.append(f"| {cell['model']} | {cell['threads']} | {label} | {_f(wall)} | {ratio} | {_f(own)} | "
                         f"{_f(cpu)} | {cratio} | {sratio} | {n} | {load} | {cell.get('commit', '-')} |")
    return lines


def _sweep_table(data: dict) -> list:
    lines = []
    for key, cell in data["cells"].items():
        if not key.startswith("sweep|"):
            continue
        s = cell["settings"]
        base = _med(s.get("n_ubatch 512 (llama-server's, ours)", {}).get("cpu_tok_s", []))
        lines += ["", f"### {cell['model']}: the engine alone (LlamaCppEngine.forward_last, {cell['tokens']} tokens, "
                      "1 thread on core 0, settings interleaved)", "",
                  "| setting | tok/s (wall) | tok/s per CPU s | vs llama-server's setting (CPU) |", "|---|---|---|---|"]
        for name, v in s.items():
            cpu = _med(v["cpu_tok_s"])
            lines.append(f"| {name} | {_f(_med(v['tok_s']))} | {_f(cpu)} | "
                         f"{_f(cpu / base, 3) + '×' if base and cpu else '-'} |")
    return lines


def _parallel_table(data: dict) -> list:
    p = data["cells"].get("parallel")
    if not p:
        return []
    lines = ["", f"## {p['clients']} concurrent clients ({p['model']}, {p['requests_each']} chat requests each, "
                 f"up to {p['max_tokens']} tokens, 1 thread on core 0, no star)", "",
             "| server | total tok/s (median) | vs --parallel 1 | tok/s per CPU s | p50 latency s | failed | runs | load avg |",
             "|---|---|---|---|---|---|---|---|"]
    base = _med([r["tok_s"] for r in p["runs"].get("ours --parallel 1", [])])
    for label, runs in p["runs"].items():
        tps = _med([r["tok_s"] for r in runs])
        lines.append(f"| {label} | {_f(tps)} | {_f(tps / base, 2) + '×' if base and tps else '-'} | "
                     f"{_f(_med([r['cpu_tok_s'] for r in runs]))} | {_f(_med([r['p50_s'] for r in runs]), 2)} | "
                     f"{sum(r['failed'] for r in runs)} | {len(runs)} | {_load(runs)} |")
    return lines


def write_report(data: dict, out: Path) -> None:
    m = data["machine"]
    lines = ["# Prefill speed: ours vs llama-server, same GGUF, threads and cores (issue 44 item 4)", "",
             f"CPU: {m['cpu']} ({m['cpus']} cpus), host {m['host']}; shared with other work: the load average "
             "(1 minute, 2 cpus) is given per row. One thread on core 0, two on cores 0-1 (taskset), both servers "
             "up side by side, requests interleaved (order alternating). A request: a prompt of token ids "
             "(MT-bench text, a different first token each time: no prefix reused; `cached_tokens` 0 checked), "
             "one completion token. Prompt tok/s (wall) = prompt tokens / the request's wall time; the server's own = "
             "its `timings.prompt_per_second` (its prompt phase, without HTTP); per CPU s = "
             "prompt tokens / the server process's CPU seconds for it (at one thread the figure other work "
             "disturbs least). llama-server runs with its defaults (CPU weight repacking on); for a K-quant GGUF, "
             "which ours keeps unrepacked for a faster prefill (docs/models.md), `llama-server --no-repack` "
             "is the same weight layout and kernels as ours. Medians.", "",
             "Commands (the runs that filled it, one resumable JSON): "
             + "; ".join(f"`{c}`" for c in data.get("commands", [])), ""]
    lines += _prefill_table(data) + _sweep_table(data) + _parallel_table(data)
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    out.with_suffix(".json").write_text(json.dumps(data, indent=1))
    _plot(data, out.with_suffix(".png"))


def _plot(data: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    cells = [c for c in data["cells"].values() if "samples" in c]
    if not cells:
        return
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for ax, idx, title in ((axes[0], 1, "prompt tok/s (wall)"), (axes[1], 2, "prompt tok/s per CPU second")):
        labels = [f"{c['model'].replace('qwen2.5-coder-', '')}\n{c['threads']} thr" for c in cells]
        series = (("ours", "ours (endpoint)"), ("llama-server", "llama-server"),
                  ("llama-server --no-repack", "llama-server --no-repack"))
        for k, (key, legend) in enumerate(series):
            ys = [({r[0]: r for r in cell_rows(c)}.get(key) or (0, 0, 0))[idx] or 0 for c in cells]
            if k < 2 or any(ys):
                ax.bar([i + (k - 1) * 0.27 for i in range(len(labels))], ys, 0.27, label=legend)
        x = range(len(labels))
        ax.set_xticks(list(x), labels)
        ax.set_title(title)
        ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=3, fontsize=8)
    fig.suptitle(f"{data['cells'][next(iter(data['cells']))].get('tokens', '')}-token prompt prefill; "
                 f"{data['machine']['cpu']}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
