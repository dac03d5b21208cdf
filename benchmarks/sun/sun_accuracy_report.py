"""The SUN accuracy table's files (json, md, png), written from whatever rows are done.

Missing cells show as "-", a line names the rows still pending per task, and a third table gives
each row's wall time (the training of the specialists it was first to need + its scoring, both
summed over resumed runs). Rewritten after every row, so a run that spans sessions always has a
current table.
"""
from __future__ import annotations

import json
import os
import platform
from pathlib import Path
from typing import Dict, Optional, Sequence

from edge.telemetry.cpu_info import cpu_name
from export.sun_eval import ROW_TITLES, markdown_table


def machine() -> dict:
    return {"platform": platform.platform(), "cpu": cpu_name(), "cpus": os.cpu_count(),
            "load1": round(os.getloadavg()[0], 2)}


def pending(results: dict, tasks: Sequence[str], rows: Sequence[str]) -> Dict[str, list]:
    cells = results.get("cells", {})
    return {t: [r for r in rows if r not in cells.get(t, {})] for t in tasks
            if any(r not in cells.get(t, {}) for r in rows)}


def wall_table(results: dict, tasks: Sequence[str], rows: Sequence[str], titles: dict) -> str:
    head = "| row | " + " | ".join(tasks) + " |\n|---|" + "---:|" * len(tasks) + "\n"
    lines = []
    for r in rows:
        shown = []
        for t in tasks:
            c = results["cells"].get(t, {}).get(r)
            if c is None or "score_s" not in c:
                shown.append("-" if c is None else "(reused)")
            else:
                shown.append(f"{c['train_s'] / 3600:.2f} + {c['score_s'] / 3600:.2f}")
        lines.append(f"| {titles.get(r) or ROW_TITLES.get(r, r)} | " + " | ".join(shown) + " |")
    return head + "\n".join(lines) + "\n"


def cells_by_cpu(results: dict, tasks: Sequence[str], rows: Sequence[str], titles: dict) -> str:
    """Which CPU scored which cells (a table resumed across sessions may span machines), and the step
    each int4 re-tune kept; cells from before a cell recorded its CPU say so."""
    by: Dict[str, list] = {}
    for t in tasks:
        for r in rows:
            c = results["cells"].get(t, {}).get(r)
            if c is not None:
                kept = "; ".join(f"step {s} kept" for s in c.get("picked_step", {}).values())
                name = f"{t} {titles.get(r) or ROW_TITLES.get(r, r)}" + (f" ({kept})" if kept else "")
                by.setdefault(c.get("cpu", "not recorded in the cell"), []).append(name)
    return "".join(f"* {cpu}: {', '.join(names)}\n" for cpu, names in by.items())


def with_ext(stem: Path, ext: str) -> Path:
    """stem + ext, where the stem may hold a dot of its own (qwen0.5b: not Path.with_suffix's qwen0.json)."""
    return stem.parent / (stem.name + ext)


def write(results: dict, out: Path, tasks: Sequence[str], rows: Sequence[str], titles: dict, model: str,
          notes: str, args: dict, eval_sizes: Optional[Dict[str, int]] = None) -> str:
    """out.{json,md,png}; returns the markdown. eval_sizes: held-out prompts per task (default: as scored)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    for t in tasks:
        results["cells"].setdefault(t, {})
    todo = pending(results, tasks, rows)
    sizes = eval_sizes or {t: next((c["n"] for c in results["cells"][t].values() if "n" in c), None) for t in tasks}
    loads = [c["load1"] for t in tasks for c in results["cells"][t].values() if "load1" in c]
    doc = dict(results, machine=machine(), args=args, pending=todo, eval_sizes=sizes)
    tmp = with_ext(out, ".json.tmp")
    tmp.write_text(json.dumps(doc, indent=1))
    tmp.replace(with_ext(out, ".json"))
    m = doc["machine"]
    status = ("Pending rows: " + "; ".join(f"{t}: {', '.join(rs)}" for t, rs in todo.items()) + ".\n"
              if todo else "All rows done.\n")
    md = (f"# SUN accuracy table, base {model}\n\n{'**Partial.** ' if todo else ''}{status}\n"
          f"Score (BFCL AST / HumanEval pass@1 / exact match, greedy):\n\n"
          f"{markdown_table(results, rows, titles=titles)}\n"
          f"Answer cross-entropy (nats/token):\n\n{markdown_table(results, rows, 'ce', titles)}\n"
          f"Wall time per row, hours (training of the specialists it was first to need + scoring, summed "
          f"over resumed runs):\n\n{wall_table(results, tasks, rows, titles)}\n"
          f"Held-out prompts per task: {', '.join(f'{t} {n}' for t, n in sizes.items() if n)}; one seed, "
          f"greedy decoding.\n{notes}\n"
          f"Machine of the last write: {m['cpu']}, {m['cpus']} CPUs, {m['platform']}; 1-minute load average "
          f"when each row finished: {', '.join(f'{x:g}' for x in loads) or '-'} (cores shared with other work). "
          f"Cells by the CPU that scored them:\n\n{cells_by_cpu(results, tasks, rows, titles)}")
    with_ext(out, ".md").write_text(md)
    _plot(results, with_ext(out, ".png"), tasks, rows, titles)
    return md


def _plot(results: dict, path: Path, tasks: Sequence[str], rows: Sequence[str], titles: dict) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(2 + 2 * len(tasks), 4))
    w = 0.8 / max(1, len(rows))
    for i, r in enumerate(rows):
        ys = [results["cells"][t].get(r, {}).get("acc", 0) for t in tasks]
        ax.bar([j + i * w for j in range(len(tasks))], ys, w, label=titles.get(r) or ROW_TITLES.get(r, r))
    ax.set_xticks([j + 0.4 - w / 2 for j in range(len(tasks))], tasks)
    ax.set_ylabel("score (missing rows: 0)")
    ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
