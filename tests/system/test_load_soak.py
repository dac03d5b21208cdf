"""The soak (#12 part 5): the load star of tests/system/test_load.py kept busy for a long time.

    STARSUN_SOAK_S=1800 .venv/bin/python -m pytest -m soak tests/system/test_load_soak.py -s

Outside the default run (pyproject's addopts deselect the `soak` marker; it is `slow` too,
so `-m "not slow"` leaves it out as well). For STARSUN_SOAK_S seconds (default 1800) the 256
emulated targets (STARSUN_SOAK_N) generate back to back through the draft service, while the
SUN pool serves rounds of 32 mixed requests. Sampled every second: the hub process's RSS (it
hosts the draft service and every SUN node) and Mosquitto's must stay flat (the last third's
median within 10% or 8 MB of the first third's, after a warm-up fifth), no queue or table may
grow (the last third's median never above the first third's peak), every SUN answer must be
the one-process greedy output, and at the end nothing may be left.
"""
from __future__ import annotations

import os
import threading
import time

import pytest
import torch

from edge.star.draft_service import DraftLimits
from server.mosquitto import MosquittoBroker
from harness.load_monitor import rss_mb
from harness.load_star import LoadConfig, LoadStar
from harness.load_sun import SunPool, jobs, wrong
from harness.waiting import wait_until

torch.set_num_threads(1)
pytestmark = [pytest.mark.soak, pytest.mark.slow, pytest.mark.broker]
SOAK_S = float(os.environ.get("STARSUN_SOAK_S", "1800"))
N = int(os.environ.get("STARSUN_SOAK_N", "256"))
# Exactly N sessions and a KV limit that binds hard (8 MB holds 122 of the engine's 64-token
# buffers): joins are refused (a target's next one may come before its last bye, or the KV is
# full) and retried in the background all the time. A retry the target gave up on, or one still
# on its way when its generation ended, used to leave an accepted session nobody closed until
# eviction, until the table was full of them; now such an acceptance is closed at once (bye).
SESSIONS = int(os.environ.get("STARSUN_SOAK_SESSIONS", str(N)))
KV_MB = float(os.environ.get("STARSUN_SOAK_KV_MB", "8"))
SUN_ROUND, SUN_SEEDS = 32, 8          # requests per round; rounds repeat 8 request sets


def test_soak_keeps_memory_flat_and_no_queue_grows(tmp_path):
    broker = MosquittoBroker().start()
    star = LoadStar(broker.url, DraftLimits(max_sessions=SESSIONS, max_kv_mb=KV_MB), workdir=tmp_path)
    pool = SunPool(broker.url)
    window, bad, served, stop = [0.0, 0.0], [], [0], threading.Event()

    def sun_rounds() -> None:
        k = 0
        while not stop.is_set() and time.monotonic() < window[1]:
            todo = jobs(SUN_ROUND, seed=k % SUN_SEEDS)
            bad.extend(wrong(pool, todo, pool.serve(todo)))
            served[0] += len(todo)
            k += 1
    sun = threading.Thread(target=sun_rounds, daemon=True)

    def start_sun() -> None:
        window[:] = [time.monotonic(), time.monotonic() + SOAK_S]
        sun.start()
    probes = {**pool.probes(), "broker_rss_mb": lambda: rss_mb(broker.proc.pid)}
    cfg = LoadConfig(n=N, procs=4, max_sessions=SESSIONS, max_kv_mb=KV_MB, generations=0, duration_s=SOAK_S,
                     hold=False, record=False, every_s=1.0)
    try:
        for s in range(SUN_SEEDS):                       # the one-process answers, before the clock starts
            for j in jobs(SUN_ROUND, seed=s):
                pool.expect(*j)
        run = star.run(cfg, extra_probes=probes, during=start_sun)
        stop.set()
        sun.join(120)
        assert star.drained(), {k: v() for k, v in star.probes().items()}
        assert wait_until(pool.drained, 30), {k: v() for k, v in pool.probes().items()}
    finally:
        stop.set()
        pool.close()
        star.close()
        broker.close()
    mon, win = run.monitor, tuple(window)
    gens = sum(t["generations"] for t in run.targets)
    rss = mon.values("rss_mb", win)
    print(f"\nsoak {SOAK_S:g} s: {N} targets, {gens} generations, {run.stats['requests']} draft answers, "
          f"{served[0]} SUN requests, {star.hub.counters['refused']} joins refused; "
          f"rss {rss[0]:.0f} -> {rss[-1]:.0f} MB")
    assert [t["error"] for t in run.targets if t["error"]] == []
    assert gens >= 2 * N and served[0] >= SUN_ROUND and bad == [], bad[:3]
    report = []
    for name in ("rss_mb", "broker_rss_mb"):
        ok, line = mon.flat(name, window=win)
        report.append((ok, line))
    for name in [k for k in mon.samples if not k.endswith("rss_mb")]:
        ok, line = mon.no_growth(name, window=win)
        report.append((ok, line))
    print("\n".join(line for _, line in report))
    assert all(ok for ok, _ in report), [line for ok, line in report if not ok]
