"""Concurrent clients: each sends MT-bench first turns back to back (streamed); total completion
tok/s over the window, p50 / p99 latency, TTFT p50. The part "serial" is the same requests sent by
one client one after another, on the same server: the one-at-a-time figure the concurrent one is
measured against: its prompts were the concurrent part's, so a server that keeps them (llama-server's
--cache-ram, ours' saved prompts) answers from its prompt cache -- each request's cached_tokens says.
The server process's CPU seconds over the cell's completion tokens ("CPU ms a token",
prefills included; ours-star: the target process, not its hub and draft service) compare servers
measured at different loads better than their tok/s do."""
from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, List, Optional

from benchmarks.lib.chat_client import ServerGone, chat_stream
from benchmarks.lib.server_process import process_cpu_s
from benchmarks.serving.agent_workload.store import median_of

if TYPE_CHECKING:
    from benchmarks.serving.agent_workload.servers import Server
    from benchmarks.serving.agent_workload.store import Store


def run_concurrent(server: Server, store: Store, prompts: List[str], args, parallel: Optional[int],
                   part: str = "concurrent") -> None:
    """`--clients` clients of `--requests` requests each ("serial": one client sending them all)."""
    import numpy as np
    cell = store.cell(server.name, server.model, part)
    n_total = args.clients * args.requests
    clients, per_client = (1, n_total) if part == "serial" else (args.clients, args.requests)
    results: List[dict] = []
    lock = threading.Lock()

    def client(i: int) -> None:
        for j in range(per_client):
            text = prompts[(i * per_client + j) % len(prompts)]
            t0 = time.perf_counter()
            try:
                r = chat_stream(server.url, {"model": Path(str(server.model)).name, "temperature": 0,
                                             "messages": [{"role": "user", "content": text}],
                                             "max_tokens": args.concurrent_tokens}, args.timeout)
            except ServerGone as e:
                r = {"status": 0, "error": str(e), "total_s": time.perf_counter() - t0}
            with lock:
                results.append({"client": i, "start": t0, "end": time.perf_counter(), **{
                    k: r.get(k) for k in ("status", "ttft_s", "total_s", "completion_tokens", "prompt_tokens",
                                          "cached_tokens", "error")}})

    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    cpu0 = _cpu_s(server)
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    cpu1 = _cpu_s(server)
    cpu_s = cpu1 - cpu0 if cpu0 is not None and cpu1 is not None else None
    ok = [r for r in results if r["status"] == 200]
    tokens = sum(r["completion_tokens"] or 0 for r in ok)
    window = max(r["end"] for r in results) - min(r["start"] for r in results)
    lat = [r["total_s"] for r in ok]
    cell.update(requests=[{k: v for k, v in r.items() if k not in ("start", "end")} for r in results])
    cell["summary"] = {"clients": clients, "requests": len(results), "failed": len(results) - len(ok),
                       "window_s": window, "tokens": tokens, "tok_s": tokens / window,
                       "server_cpu_s": cpu_s,
                       "cpu_ms_per_token": 1e3 * cpu_s / tokens if tokens and cpu_s is not None else None,
                       "p50_s": float(np.percentile(lat, 50)) if lat else None,
                       "p99_s": float(np.percentile(lat, 99)) if lat else None,
                       "ttft_p50_s": median_of([r["ttft_s"] for r in ok]),
                       "prompt_tokens": sum(r.get("prompt_tokens") or 0 for r in ok),
                       "cached_tokens": sum(r.get("cached_tokens") or 0 for r in ok),
                       "server_parallel": parallel}
    cell["done"] = True
    store.save()
    print(f"{server.name} {server.model} {part}: {cell['summary']}", flush=True)


def _cpu_s(server: Server) -> Optional[float]:
    """The server process's CPU seconds so far; None once it is gone."""
    try:
        return process_cpu_s(server.proc.pid)
    except OSError:
        return None
