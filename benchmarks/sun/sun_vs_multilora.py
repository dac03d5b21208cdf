"""SUN against llama-server's multi-LoRA on the same base GGUF and the same GGUF LoRA files (issue 45 item 3).

    (the adapters, once: the commands in benchmarks/lib/multilora_prep.py; ~1 h on 2 loaded cores)
    .venv/bin/python -m benchmarks.sun.sun_vs_multilora         # 8 and 64 tasks (resumes cell by cell)
    .venv/bin/python -m benchmarks.sun.sun_vs_multilora --quick # a smoke run: 2 tasks, 6 requests
    .venv/bin/python -m benchmarks.sun.sun_vs_multilora --workload code --out .../code  # decode-heavy variant

A user with many LoRA adapters on one base runs either
* llama-server with every adapter loaded (`--lora` per file) and the per-request `lora` field (every
  adapter's scale explicit: the task's 1, the others 0), which batches only requests whose adapter
  sets are equal; or
* SUN: the hub (router, OpenAI endpoint, the shared decoder) and ONE prefill worker holding every
  adapter over one base, over Mosquitto (benchmarks/lib/multilora_sides.py says how each starts).

Both load the same Q4_0 GGUF of Qwen2.5-Coder-0.5B-Instruct and the same GGUF LoRA files
(benchmarks/lib/multilora_prep.py says how they were made), run pinned to the same cores with the
one llama.cpp thread per process (llama-server -t 1 -tb 1; SUN's prefill worker and decoder one each,
time-sharing the same core: on cores shared with other work, llama.cpp's spinning thread barriers
collapse when a process has more threads than it gets cores) and the same sequence slots (llama-server -np S, S x CTX context; SUN's decoder
--sun-max-batch S). A burst of requests (all at once; Zipf(1.1) task popularity; request r asks
held-out BFCL item r mod n) is answered greedily by each side in turn (benchmarks/lib/multilora_burst.py).
Per cell: total tok/s, TTFT p50/p99, peak RSS / PSS of the side's processes, task accuracy (BFCL AST
check). The adapters differ by design: llama-server applies an adapter to every token, SUN to the
prompt only; the rows "lora" give llama-server adapters tuned the ordinary way (its fair row), "none"
the bare base (all scales 0).

Writes benchmarks/results/sun_vs_multilora/<variant>.{json,md,png}; every finished cell is kept in the
JSON and never rerun (delete it from "cells" to redo it).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import sys
import time
from pathlib import Path

from benchmarks.lib import multilora_prep as prep
from benchmarks.lib.multilora_plan import burst, cell_key, task_name
from benchmarks.lib.results import ROOT, result_stem


def args_of(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tasks", default="8,64", help="comma list of task counts")
    ap.add_argument("--requests", type=int, default=32, help="requests in a burst")
    ap.add_argument("--workload", default="bfcl", choices=("bfcl", "code"), help="what the burst asks "
                    "(benchmarks/lib/multilora_workloads.py): BFCL tool calls (prefill-bound, the record) or "
                    "HumanEval functions (decode-heavy)")
    ap.add_argument("--max-tokens", type=int, default=None, help="new tokens at most (default: 64 bfcl, 224 code)")
    ap.add_argument("--max-chars", type=int, default=1500, help="held-out items whose prompt is at most this long")
    ap.add_argument("--slots", type=int, default=16, help="llama-server -np; SUN decoder --sun-max-batch")
    ap.add_argument("--ctx", type=int, default=1024, help="context per slot / sequence")
    ap.add_argument("--threads", type=int, default=1, help="llama-server -t and -tb")
    ap.add_argument("--sun-threads", default="1,1", help="SUN prefill worker, decoder threads")
    ap.add_argument("--split", action="store_true", help="SUN's decoder in the hub and the base loaded again by "
                    "the prefill worker (the first record's SUN); default: both over one base in one process "
                    "(edge-agent run --role prefill --with-decoder)")
    ap.add_argument("--cores", default="1", help="taskset -c for every server process of both sides")
    ap.add_argument("--client-cores", default="0", help="where this process (the clients) runs")
    ap.add_argument("--extra", default="lora,none", help="llama-server-only rows at the smallest task count: "
                    "lora (ordinarily tuned adapters), none (the bare base)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--work", type=lambda p: Path(p).resolve(), default=prep.WORK, help="where the decoder, bundle, adapters and logs are")
    ap.add_argument("--quick", action="store_true", help="smoke run: 2 tasks, 6 requests, 16 tokens, no extra rows")
    ap.add_argument("--out", type=Path, default=None, help="result stem (default: .../sun_vs_multilora/default)")
    a = ap.parse_args(argv)
    if a.quick:
        a.tasks, a.requests, a.max_tokens, a.extra, a.slots = "2", 6, 16, "", 4
    from benchmarks.lib.multilora_workloads import DEFAULT_MAX_TOKENS
    a.max_tokens = a.max_tokens or DEFAULT_MAX_TOKENS[a.workload]
    a.task_counts = [int(x) for x in a.tasks.split(",") if x]
    a.pre_threads, a.dec_threads = (int(x) for x in a.sun_threads.split(","))
    a.out = a.out or result_stem("sun_vs_multilora", "quick" if a.quick else "default")
    return a


def cells_of(a) -> list:
    """(side, adapters, n_tasks) in running order: the two sides of a task count back to back."""
    out = [(side, "sun-lora", n) for n in a.task_counts for side in ("llama-server", "sun")]
    return out + [("llama-server", kind, min(a.task_counts)) for kind in a.extra.split(",") if kind]


def machine() -> dict:
    from edge.telemetry.cpu_info import cpu_name
    return {"cpu": cpu_name(), "cpus": os.cpu_count(), "host": socket.gethostname(), "python": platform.python_version()}


def server_bin() -> Path:
    found = sorted(Path.home().glob(".cache/starsun/llama-tools-*/bin/llama-server"))
    if not found:
        raise SystemExit("no llama-server: `make llama-tools` builds it under ~/.cache/starsun/llama-tools-*/bin")
    return found[-1]


def tuned_record(d: Path) -> dict:
    """What the report says of a tuned adapter: its steps, batch, lr, last losses, train time."""
    m = json.loads((d / "manifest.json").read_text())
    t = m.get("tune") or {}
    hist = m.get("history_tail") or m.get("history") or []
    return {"dir": d.name, "kind": m.get("kind"), "steps": t.get("steps"), "batch_size": t.get("batch_size"),
            "lr": t.get("lr"), "seed": t.get("seed"), "last": hist[-2:]}


class Store:
    def __init__(self, path: Path):
        self.path = path
        self.data = json.loads(path.read_text()) if path.is_file() else {"cells": {}, "runs": []}

    def save(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.data, indent=1))
        tmp.replace(self.path)


def make_side(side: str, adapters: str, n: int, a, base: Path, logdir: Path):
    from benchmarks.lib.multilora_sides import LlamaServerSide, SunSide
    kind = "sun-lora" if adapters == "none" else adapters
    files = prep.task_files(kind, n, base, a.work)
    if side == "llama-server":
        return LlamaServerSide(server_bin(), base, files, a.slots, a.ctx, a.threads, a.cores, logdir)
    return SunSide(base.parent, {task_name(i): f for i, f in enumerate(files)}, prep.BASE, a.slots,
                   a.pre_threads, a.dec_threads, a.cores, logdir, colocated=not a.split)


def run_cell(side: str, adapters: str, n: int, a, base: Path, items: list) -> dict:
    from benchmarks.lib.multilora_burst import run_burst, warm_up
    from benchmarks.lib.multilora_plan import summarize
    logdir = a.work / "logs" / f"{side}-{adapters}-{n}"
    s = make_side(side, adapters, n, a, base, logdir)
    t_start = time.perf_counter()
    try:
        s.start()
        start_s = time.perf_counter() - t_start
        warm_up(s, items[0], n, adapters)
        reqs = burst(n, a.requests, len(items), a.seed)
        got = run_burst(s, reqs, items, a.max_tokens, n, adapters)
    finally:
        s.stop()
    return {"side": side, "adapters": adapters, "n_tasks": n, "started": time.strftime("%Y-%m-%d %H:%M:%S"),
            "start_s": round(start_s, 1), **s.describe(), "summary": summarize(got["rows"], got["wall_s"]),
            "memory": got["memory"], "loadavg_before": got["loadavg_before"], "loadavg_after": got["loadavg_after"],
            "adapter_sources": prep.sources_of("sun-lora" if adapters == "none" else adapters, n, a.work),
            "rows": got["rows"]}


def main(argv=None) -> None:
    from benchmarks.lib.multilora_report import write_report
    a = args_of(argv)
    os.sched_setaffinity(0, {int(c) for c in a.client_cores.split(",")})     # the clients: off the servers' cores
    store = Store(a.out.with_suffix(".json"))
    d = store.data
    d.setdefault("machine", machine())
    d["config"] = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(a).items()}
    d["runs"].append({"started": time.strftime("%Y-%m-%d %H:%M:%S"), "argv": sys.argv[1:], "loadavg": os.getloadavg()})
    base = prep.bundle(a.work)
    d["base_gguf"] = str(base.resolve().relative_to(ROOT))
    d["tuned"] = {k: [tuned_record(p) for p in v] for k, v in prep.tuned(a.work).items()}
    from benchmarks.lib.multilora_workloads import items_of
    items = items_of(a.workload, a.max_chars)
    d["items"] = len(items)
    store.save()
    for side, adapters, n in cells_of(a):
        key = cell_key(side, adapters, n)
        if d["cells"].get(key, {}).get("summary"):
            print(f"{key}: done, kept", flush=True)
            continue
        if adapters != "none" and not prep.tuned(a.work)[adapters]:
            print(f"{key}: no tuned {adapters} adapter yet, left for a later run", flush=True)
            continue
        print(f"{key}: running ({a.requests} requests, load {os.getloadavg()[0]:.1f})", flush=True)
        d["cells"][key] = run_cell(side, adapters, n, a, base, items)
        store.save()
        print(f"{key}: {d['cells'][key]['summary']}", flush=True)
        write_report(d, a.out)
    write_report(d, a.out)
    print(f"wrote {a.out}.md", flush=True)


if __name__ == "__main__":
    main()
