"""One cell of benchmarks/sun/sun_vs_multilora.py: a burst of streamed chat requests on a started side.

Every request is sent at once (one client thread each), streamed, greedy (temperature 0), at most
`max_tokens` new tokens. TTFT: from the burst's start to the request's first content chunk (the
wait in the server's queue included: a burst). tok/s: all completion tokens / the burst's wall
time (first send to last answer). Each answer is scored by its workload (benchmarks/lib/multilora_workloads.py).
"""
from __future__ import annotations

import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import List, Sequence

from benchmarks.lib.chat_client import ServerGone, chat_stream


def _burst_stream(url: str, body: dict, timeout: float, t0: float) -> dict:
    """One streamed request of the burst, times from t0 (the burst's start); a server gone is a
    row with status 0, not an exception (the burst's other rows still count)."""
    try:
        r = chat_stream(url, body, timeout, t0)
    except ServerGone as e:
        return {"status": 0, "error": str(e), "end_s": time.perf_counter() - t0}
    r["end_s"] = r.pop("total_s")
    return r


def messages(prompt: str) -> List[dict]:
    return [{"role": "user", "content": prompt}]


def run_burst(side, requests: Sequence[dict], items: Sequence[dict], max_tokens: int, n_tasks: int,
              adapters: str, timeout: float = 1800.0) -> dict:
    """The burst on `side` (its processes' memory sampled meanwhile) -> {"rows", "wall_s", "memory", ...}."""
    from benchmarks.lib.multilora_workloads import correct
    side.memory.start()
    load0 = os.getloadavg()
    t0 = time.perf_counter()
    go = threading.Barrier(len(requests))

    def one(req: dict) -> dict:
        task = None if adapters == "none" else req["task"]
        body = {**side.body(task, n_tasks), "messages": messages(items[req["item"]]["prompt"]),
                "max_tokens": max_tokens, "temperature": 0}
        go.wait()                                   # every client connected: send together
        r = _burst_stream(side.url, body, timeout, t0)
        if r["status"] == 200:
            r["correct"] = correct(items[req["item"]], r["content"])
        return {**req, **r}

    with ThreadPoolExecutor(max_workers=len(requests)) as pool:
        rows = list(pool.map(one, requests))
    wall = max((r["end_s"] for r in rows), default=0.0)
    memory = side.memory.stop()
    return {"rows": rows, "wall_s": wall, "memory": memory, "loadavg_before": load0, "loadavg_after": os.getloadavg()}


def warm_up(side, item: dict, n_tasks: int, adapters: str) -> dict:
    """One request before the burst (the first call builds llama.cpp's graphs); not counted."""
    body = {**side.body(None if adapters == "none" else 0, n_tasks), "messages": messages(item["prompt"]),
            "max_tokens": 4, "temperature": 0}
    end = time.monotonic() + 300
    while True:                # a 503 while the hub's router still proves the worker alive: ask again
        r = _burst_stream(side.url, body, 600, time.perf_counter())
        if r["status"] == 200:
            return r
        if r["status"] not in (400, 503) or time.monotonic() > end:   # 400: no worker lists the task (yet)
            raise RuntimeError(f"{side.name}: the warm-up request failed: {r}")
        time.sleep(2)
