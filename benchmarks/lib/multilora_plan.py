"""The pure parts of benchmarks/sun/sun_vs_multilora.py: the burst, llama-server's `lora` field, the
summary of a cell and the table (no processes, no models: tests/unit/test_sun_vs_multilora.py).

A burst: n_requests all sent at t=0; request r asks task `zipf_tasks(...)[r]` (Zipf(s) popularity
over the tasks, the same law as benchmarks/sun/sun_adapters.py) about held-out item
`r % n_items`, so both sides answer the same items under the same tasks' adapters.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence

import numpy as np

ZIPF_S = 1.1


def zipf_tasks(n_tasks: int, n_requests: int, seed: int = 0, s: float = ZIPF_S) -> List[int]:
    """Task index of each request of a burst: P(task k) ~ 1 / (k+1)^s, seeded."""
    if n_tasks < 1 or n_requests < 0:
        raise ValueError(f"need n_tasks >= 1 and n_requests >= 0, got {n_tasks}, {n_requests}")
    rng = np.random.default_rng(seed)
    p = 1.0 / np.arange(1, n_tasks + 1) ** s
    return [int(t) for t in rng.choice(n_tasks, size=n_requests, p=p / p.sum())]


def burst(n_tasks: int, n_requests: int, n_items: int, seed: int = 0) -> List[Dict[str, int]]:
    """[{"request": r, "task": t, "item": i}]: the requests of one burst, in sending order."""
    if n_items < 1:
        raise ValueError("need at least one held-out item")
    return [{"request": r, "task": t, "item": r % n_items}
            for r, t in enumerate(zipf_tasks(n_tasks, n_requests, seed))]


def lora_field(task: Optional[int], n_adapters: int, scale: float = 1.0) -> List[Dict[str, float]]:
    """llama-server's per-request `lora`: EVERY loaded adapter with an explicit scale, the task's at
    `scale` and the others at 0 (an empty list does not zero them: the server then applies its
    start-up scales, 1.0 each). task None: the bare base (all zero)."""
    if task is not None and not 0 <= task < n_adapters:
        raise ValueError(f"task {task} outside the {n_adapters} loaded adapters")
    return [{"id": i, "scale": float(scale) if i == task else 0.0} for i in range(n_adapters)]


def task_name(task: int) -> str:
    """The name a task is served under (SUN's model field, the bundle's adapter entry)."""
    return f"t{task}"


def percentile(xs: Sequence[float], q: float) -> Optional[float]:
    xs = [x for x in xs if x is not None]
    return float(np.percentile(xs, q)) if xs else None


def summarize(rows: Sequence[dict], wall_s: float) -> dict:
    """One cell's figures from its requests' rows ({"ttft_s", "completion_tokens", "correct", "status"})."""
    ok = [r for r in rows if r.get("status") == 200]
    toks = sum(int(r.get("completion_tokens") or 0) for r in ok)
    scored = [r for r in ok if r.get("correct") is not None]
    return {"requests": len(rows), "ok": len(ok), "completion_tokens": toks, "wall_s": wall_s,
            "tok_s": toks / wall_s if wall_s > 0 else None,
            "ttft_p50_s": percentile([r.get("ttft_s") for r in ok], 50),
            "ttft_p99_s": percentile([r.get("ttft_s") for r in ok], 99),
            "accuracy": sum(bool(r["correct"]) for r in scored) / len(scored) if scored else None,
            "scored": len(scored)}


def _fmt(x, spec: str) -> str:
    return "" if x is None else format(x, spec)


def _mb(b) -> str:
    return "" if b is None else f"{b / 2**20:.0f}"


COLUMNS = ("tasks", "side", "adapters", "requests ok", "tok/s", "tok per CPU s", "TTFT p50", "TTFT p99",
           "peak RSS (MiB)", "peak PSS (MiB)", "accuracy", "SUN / llama-server tok/s")


def table(cells: Dict[str, dict]) -> List[str]:
    """Markdown rows, one per finished cell (tasks, then side); the tok/s ratio on SUN's rows against
    llama-server's row of the same tasks and adapters."""
    done = sorted((c for c in cells.values() if c.get("summary")),
                  key=lambda c: (c["n_tasks"], c["adapters"], c["side"] != "llama-server"))
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for c in done:
        s, m = c["summary"], c.get("memory") or {}
        peer = cells.get(cell_key("llama-server", c["adapters"], c["n_tasks"]), {}).get("summary") or {}
        ratio = (s["tok_s"] / peer["tok_s"] if c["side"] == "sun" and s.get("tok_s") and peer.get("tok_s")
                 else None)
        acc = "" if s.get("accuracy") is None else f"{s['accuracy']:.3f} ({s['scored']})"
        lines.append("| " + " | ".join([
            str(c["n_tasks"]), c["side"], c["adapters"], f"{s['ok']}/{s['requests']}", _fmt(s.get("tok_s"), ".1f"),
            _fmt(s["completion_tokens"] / m["cpu_s"] if m.get("cpu_s") else None, ".1f"),
            _fmt(s.get("ttft_p50_s"), ".2f") + (" s" if s.get("ttft_p50_s") is not None else ""),
            _fmt(s.get("ttft_p99_s"), ".2f") + (" s" if s.get("ttft_p99_s") is not None else ""),
            _mb(m.get("peak_rss_sum")), _mb(m.get("peak_pss_sum")), acc,
            "" if ratio is None else f"{ratio:.2f}x"]) + " |")
    return lines


def cell_key(side: str, adapters: str, n_tasks: int) -> str:
    return f"{side}/{adapters}/{n_tasks}"
