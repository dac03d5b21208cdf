"""4 concurrent clients against ours at --parallel 1 and --parallel 4 (and llama-server -np 4), for
benchmarks/engines/prefill_speed.py --parallel: the target endpoint alone (no star), one thread on core 0.

Each client sends REQUESTS chat requests one after another (MT-bench first turns, up to MAX_TOKENS
tokens, temperature 0); a run's total tok/s is every completion token over the run's wall time.
The servers stay up side by side and the runs alternate, ROUNDS each.
"""
from __future__ import annotations

import os
import statistics
import threading
import time
from pathlib import Path

from benchmarks.lib.datasets import mtbench_first_turns
from benchmarks.lib.prefill_servers import LlamaServer, OursServer, Server, tools_bin

CLIENTS, REQUESTS, MAX_TOKENS, ROUNDS = 4, 2, 64, 2


class _Chat:
    """A Server's chat request: (completion tokens, seconds)."""

    def __init__(self, server: Server):
        self.server = server

    def __call__(self, question: str) -> tuple:
        t = time.perf_counter()
        d = self.server._post("/v1/chat/completions", {"messages": [{"role": "user", "content": question}],
                                                        "max_tokens": MAX_TOKENS, "temperature": 0})
        return d["usage"]["completion_tokens"], time.perf_counter() - t


def _run(server: Server, questions: list) -> dict:
    """CLIENTS threads, REQUESTS each; total tok/s and latencies."""
    chat, results, errors = _Chat(server), [], []
    lock = threading.Lock()

    def client(k: int) -> None:
        for j in range(REQUESTS):
            try:
                got = chat(questions[(k * REQUESTS + j) % len(questions)])
            except Exception as e:             # a failed request is counted, not raised
                with lock:
                    errors.append(str(e)[:200])
                continue
            with lock:
                results.append(got)

    c0, t0 = server.cpu_seconds(), time.perf_counter()
    threads = [threading.Thread(target=client, args=(k,)) for k in range(CLIENTS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall, cpu = time.perf_counter() - t0, server.cpu_seconds() - c0
    tokens = sum(n for n, _ in results)
    lat = sorted(s for _, s in results)
    return {"tokens": tokens, "wall_s": round(wall, 2), "tok_s": round(tokens / wall, 2),
            "cpu_tok_s": round(tokens / max(cpu, 1e-9), 2), "p50_s": round(statistics.median(lat), 2) if lat else None,
            "max_s": round(lat[-1], 2) if lat else None, "failed": len(errors), "load1": os.getloadavg()[0]}


def run_parallel(gguf: Path, ctx: int, logdir: Path) -> dict:
    questions = mtbench_first_turns()       # fetched on first use
    servers = [OursServer(gguf, 1, ctx, logdir, label="ours --parallel 1", parallel=1),
               OursServer(gguf, 1, ctx, logdir, label="ours --parallel 4", parallel=4),
               LlamaServer(tools_bin(), gguf, 1, ctx, logdir, np_=4)]
    runs = {s.label: [] for s in servers}
    for s in servers:
        s.start([0])
    try:
        for r in range(ROUNDS):
            for s in (servers if r % 2 == 0 else list(reversed(servers))):
                got = _run(s, questions[r * CLIENTS * REQUESTS:])
                runs[s.label].append(got)
                print(f"  {s.label}: {got}", flush=True)
    finally:
        for s in servers:
            s.stop()
    return {"model": gguf.name, "clients": CLIENTS, "requests_each": REQUESTS, "max_tokens": MAX_TOKENS,
            "threads": 1, "cores": [0], "servers": {s.label: s.describe() for s in servers}, "runs": runs}
