"""Load (#12 part 5), the fast version: 256 concurrent StarSD sessions against one real draft
service, and a mixed SUN pool with one shared decoder under many concurrent requests.

StarSD: 256 emulated targets (the real target code on harness/emulated_target.py's
engine, each with its own MQTT connection, in 4 processes) join one hub whose draft service
(a tiny float64 llama) is configured for exactly 256 sessions and a KV limit below what
they would all hold at the end (counted as the engine allocates it). Every target is held
inside its session once all have joined; 8 more clients then ask for sessions. SUN: 128 mixed
requests of three tasks at once on one decoder (8 rows per step, 0.25 MiB of KV in transit,
128 sequences at most), then 6 whose KV alone is more, then 24, then 256 longer ones at once:
more than the decoder may hold.
Each load runs once per module (harness/load_star.py, harness/load_sun.py); the tests
read what it recorded. No timing is asserted: starvation is counted in steps.
"""
from __future__ import annotations

import pytest
import torch

from edge.star.draft_service import DraftLimits
from server.mosquitto import MosquittoBroker
from harness.load_monitor import Monitor
from harness.load_star import LoadConfig, LoadStar, check_proposals
from harness.load_sun import SunPool, big_jobs, first_message, jobs, refusal_codes, wrong
from harness.waiting import wait_until

torch.set_num_threads(1)
pytestmark = [pytest.mark.broker, pytest.mark.slow]
N = 256
# The engine gives each sequence 64 tokens of 1 KiB at once (16.8 MB for 256 sessions: they all
# fit at the hold), then 128 as it passes 64 tokens (7 to 16 prompt tokens + 64 new: each one
# does, 33.6 MB for all): the limit binds late in every generation
KV_MB, MAX_NEW = 24.0, 64
EXTRA = 8
MAX_BATCH, PENDING_MB = 8, 0.25
SUN_N, SUN_BIG, SUN_LATER = 128, 6, 24
SUN_OVER, OVER_NEW = 2 * SUN_N, 32     # past max_sequences = SUN_N, held long enough to overlap


@pytest.fixture(scope="module")
def star(tmp_path_factory):
    """The StarSD load, run once: (LoadStar, LoadRun, (answers checked, mismatches))."""
    broker = MosquittoBroker().start()            # our own: the test counts joins and refusals
    s = LoadStar(broker.url, DraftLimits(max_sessions=N, max_kv_mb=KV_MB),
                 workdir=tmp_path_factory.mktemp("load"))
    try:
        run = s.run(LoadConfig(n=N, procs=4, max_sessions=N, max_kv_mb=KV_MB, max_new=MAX_NEW, extra_joins=EXTRA))
        yield s, run, check_proposals(run.targets, s.model)
    finally:
        s.close()
        broker.close()


def test_every_session_gets_the_drafts_own_greedy_proposals(star):
    s, run, (checked, bad) = star
    assert [t["error"] for t in run.targets if t["error"]] == []
    assert run.held == {"held": N, "refusals": []}, "every target should hold a session at the hold"
    answered = [t for t in run.targets if t["records"].get("0")]
    assert len(answered) == N, f"{N - len(answered)} sessions never got a proposal"
    assert checked == sum(len(r) for t in run.targets for r in t["records"].values()) and checked >= 4 * N
    assert bad == [], f"{len(bad)} of {checked} answers are not the draft's greedy continuation: {bad[:3]}"


def test_sessions_past_the_limit_are_refused_with_a_reason(star):
    s, run, _ = star
    assert run.sessions_at_hold == N
    assert len(run.extra) == EXTRA and all(r and "every fitting draft service is full" in r for r in run.extra), \
        run.extra
    assert s.hub.counters["refused"] == EXTRA and s.hub.registry.refusals == EXTRA
    mon = run.monitor
    assert mon.peak("sessions") <= N and mon.peak("registry") <= N and mon.peak("engine_seqs") <= N


def test_the_kv_limit_refuses_cleanly_and_bounds_the_drafts_kv(star):
    s, run, _ = star
    refused = run.stats["counters"].get("refused_kv", 0)
    seen = sum(t["errors"].get("overloaded", 0) for t in run.targets)
    assert refused > 0 and seen == refused, (refused, seen)
    reasons = {t["messages"]["overloaded"] for t in run.targets if "overloaded" in t["messages"]}
    assert len(reasons) == 1 and f"KV memory limit of {KV_MB:g} MB" in reasons.pop()
    mon = run.monitor
    # what the limit counts, and what the torch engine really holds: both within it, batches too
    assert mon.peak("kv_mb") <= KV_MB and mon.peak("kv_alloc_mb") <= KV_MB, (mon.peak("kv_mb"),
                                                                            mon.peak("kv_alloc_mb"))
    assert mon.peak("pending") <= N                           # Q_in: one request per session
    assert mon.peak("backlog") <= 2 * N                       # a request and a bye per session at most


def test_no_request_waits_past_the_next_batch(star):
    """Every step takes everything pending: a request is served by the first step after it
    arrived (1), with N sessions and no batch cap ceil(N / ∞) = 1. Counted over every answer."""
    s, run, _ = star
    answers = sum(t["answers"] for t in run.targets)
    assert sum(run.waited.values()) == answers, (run.waited, answers)
    assert max(run.waited) == 1, f"some requests waited for more batches: {run.waited}"
    assert run.stats["batch_size_max"] > 1 and run.stats["batch_size_mean"] > 1


def test_nothing_is_left_after_every_session_closes(star):
    s, run, _ = star
    assert s.drained(), {k: v() for k, v in s.probes().items()}
    c = run.stats["counters"]
    assert c["opened"] == N and c.get("closed_bye") == N, c   # every session ended with its bye
    assert s.engine.kv_bytes() == 0


@pytest.fixture(scope="module")
def sun(tmp_path_factory):
    """The SUN load, run once: (pool, mixed results, oversized results, results after, monitor,
    (more than the decoder may hold, their results), the decoder's counters before those)."""
    broker = MosquittoBroker().start()
    pool = SunPool(broker.url, max_batch=MAX_BATCH, max_pending_mb=PENDING_MB, max_sequences=SUN_N)
    try:
        mixed, big, later = jobs(SUN_N, seed=0), big_jobs(SUN_BIG), jobs(SUN_LATER, seed=2)
        over = jobs(SUN_OVER, seed=3, max_new=OVER_NEW)
        for j in mixed + later:
            pool.expect(*j)                                 # the one-process answers, first
        with Monitor(pool.probes()) as mon:
            r_mixed = pool.serve(mixed)
            r_big = pool.serve(big)
            r_later = pool.serve(later)                     # still serving after the refusals
            wait_until(pool.drained, 20)
            before = dict(pool.dnode.stats)
            r_over = pool.serve(over)
            wait_until(pool.drained, 20)
        yield pool, (mixed, r_mixed), (big, r_big), (later, r_later), mon, (over, r_over), before
    finally:
        pool.close()
        broker.close()


def test_mixed_pool_answers_are_the_one_process_greedy_output(sun):
    pool, (mixed, r_mixed), _, (later, r_later), *_ = sun
    assert wrong(pool, mixed, r_mixed) == [] and wrong(pool, later, r_later) == []
    assert pool.dnode.tasks_served == {"maths", "code", "tools"}
    assert max(len(set(b)) for b in pool.decoder.batches) > 1, "no step mixed tasks"


def test_decoder_limits_hold_and_refuse_cleanly(sun):
    pool, _, (big, r_big), _, mon, _, before = sun
    rows = pool.rows_per_step()
    assert max(rows) == MAX_BATCH, f"rows per step should reach, never pass, max_batch: {max(rows)}"
    assert mon.peak("dec_pending_bytes") <= pool.max_pending
    assert refusal_codes(r_big) == {"overloaded": SUN_BIG}, refusal_codes(r_big)
    assert "has no room for more KV in transit (256 KiB)" in first_message(r_big, "overloaded")
    assert before["overloaded"] == SUN_BIG and before["admitted"] == SUN_N + SUN_LATER
    # max_sequences = SUN_N: running, waiting and awaited KV never pass it, whatever arrives
    assert mon.peak("dec_node_load") <= SUN_N and mon.peak("dec_engine_seqs") <= SUN_N


def test_past_max_sequences_requests_are_refused_cleanly_and_the_rest_served(sun):
    """SUN_OVER requests at once, twice what the decoder may hold: the router (from the load the
    decoder reports) or the decoder itself refuses the excess `overloaded`, with its reason (or,
    as before, for a full KV in transit); every admitted one is the one-process answer. How many
    are refused depends on how many finished meanwhile: only that some were, and the bound
    (test_decoder_limits_hold_and_refuse_cleanly), are asserted."""
    pool, *_, (over, r_over), before = sun
    codes = refusal_codes(r_over)
    assert set(codes) == {"overloaded"} and 0 < codes["overloaded"] < SUN_OVER, codes
    reasons = {f"every decoder for task '{t}' holds its limit of sequences" for t in ("maths", "code", "tools")}
    reasons |= {f"decoder dec holds its limit of {SUN_N} sequences", "decoder dec has no room for more KV in transit"}
    msgs = {err.message.split(";")[0].split(" (")[0] for _, err in r_over if err is not None}
    assert msgs <= reasons, msgs
    served = [(j, r) for j, r in zip(over, r_over) if r[1] is None]
    assert wrong(pool, [j for j, _ in served], [r for _, r in served]) == []
    d = pool.dnode.stats
    assert d["admitted"] - before["admitted"] == len(served)
    assert d["overloaded"] - before["overloaded"] + pool.router.counters.get("refused_overloaded", 0) \
        == codes["overloaded"]


def test_no_request_is_passed_over_by_the_shared_decoder(sun):
    """Round-robin: with L sequences held and B rows per step, none waits more than ceil(L / B)
    steps for its next row (counted over every row of every request)."""
    pool, *_ = sun
    d = pool.decoder
    assert d.max_load > 4 * MAX_BATCH, "the load should need many steps per round"
    assert max(d.gaps) <= d.gap_bound(), (sorted(d.gaps.items()), d.max_load)
    assert sum(d.gaps.values()) == d.tokens_out


def test_the_sun_pool_holds_nothing_afterwards(sun):
    pool, *_ = sun
    assert pool.drained(), {k: v() for k, v in pool.probes().items()}
    assert pool.dnode.stats["timeouts"] == 0 and not any(c.dropped.get("auth") for c in pool.clients)
