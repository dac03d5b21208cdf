"""Iteration-level batching in the draft service (DraftLimits.join): a request arriving while a
batch is in flight joins it at the next engine step, and every answer is still exactly the
drafts a fresh drafter makes on the target's context."""
import threading

import numpy as np

from edge.speculative.generate import generate_plain
from edge.wire.memory_link import MemoryBus, MemoryLink
from edge.wire.protocol import DraftRequest, DraftResponse
from edge.star.draft_service import DraftLimits
from edge.star.hub_client import HubClient
from edge.star.target import StarTarget
from server.hub import Hub
from harness.draft_services import contexts, make_engine, reference, service, step


def test_a_request_joins_the_batch_in_flight_and_is_answered_first():
    svc, out = service(DraftLimits(ahead=False, join=True))
    long_ctx, short_ctx = contexts(2, seed=4)
    svc.open("long")
    svc.submit(DraftRequest("long", 1, 0, long_ctx, 6))
    assert step(svc, out) == 0 and svc.has_work()            # one of its 6 steps made: in flight
    svc.open("short")
    svc.submit(DraftRequest("short", 1, 0, short_ctx, 2))
    assert step(svc, out) == 0                                # "short" joined: its first draft
    assert step(svc, out) == 1 and list(out) == ["short"]     # answered while "long" still drafts
    assert out["short"][0].tokens == reference(short_ctx, 2)
    while "long" not in out:
        assert svc.has_work()
        step(svc, out)
    assert out["long"][0].tokens == reference(long_ctx, 6)
    assert not svc.has_work()
    st = svc.stats.snapshot()
    assert st["step_of_b"]["2"]["steps"] == 2                 # the steps both were in
    assert sum(v["steps"] for v in st["step_of_b"].values()) == 6


def test_a_sessions_next_request_waits_for_its_answer_in_flight():
    svc, out = service(DraftLimits(ahead=False, join=True))
    a, b = contexts(2, seed=6)
    svc.open("s")
    svc.submit(DraftRequest("s", 1, 0, a, 5))
    step(svc, out)
    svc.submit(DraftRequest("s", 2, 0, b, 3))                 # a target that gave up on seq 1
    assert svc.pending() == 1
    while len(out.get("s", [])) < 2:
        step(svc, out)
    first, second = out["s"]
    assert (first.seq, second.seq) == (1, 2)
    assert first.tokens == reference(a, 5) and second.tokens == reference(b, 3)


def test_a_session_closed_mid_batch_frees_its_kv_and_the_rest_goes_on():
    engine = make_engine()
    svc, out = service(DraftLimits(ahead=False, join=True), engine=engine)
    ctxs = contexts(3, seed=9)
    for i, c in enumerate(ctxs):
        svc.open(f"s{i}")
        svc.submit(DraftRequest(f"s{i}", 1, 0, c, 5))
    step(svc, out)
    assert engine.active_sequences == 3
    svc.close("s1")
    while svc.has_work():
        step(svc, out)
    assert engine.active_sequences == 2 and "s1" not in out
    for i in (0, 2):
        assert out[f"s{i}"][0].tokens == reference(ctxs[i], 5)


def test_staggered_rounds_with_draft_ahead_equal_a_fresh_drafter():
    """Sessions come back at random steps (so batches are joined mid-flight), accept random
    prefixes and keep less at times; every answer equals a fresh drafter's on the context."""
    svc, out = service(DraftLimits(ahead=True, join=True))
    rng = np.random.default_rng(11)
    ctxs = contexts(4, seed=12)
    held, seq, due, rounds = {}, {}, {}, {}
    for i in range(4):
        sid = f"s{i}"
        svc.open(sid)
        held[sid], seq[sid], due[sid], rounds[sid] = 0, 1, int(rng.integers(0, 4)), 0
    gammas = {f"s{i}": g for i, g in enumerate((2, 3, 4, 5))}
    t, sizes = 0, set()
    while min(rounds.values()) < 5:
        for sid, c in zip(held, ctxs):
            if due[sid] == t:
                svc.submit(DraftRequest(sid, seq[sid], held[sid], c[held[sid]:], gammas[sid]))
        before = len(svc.stats.batch_sizes)
        for sid, msgs in _step(svc).items():
            (r,) = msgs
            c, g = ctxs[int(sid[1:])], gammas[sid]
            assert isinstance(r, DraftResponse) and r.seq == seq[sid]
            assert r.tokens == reference(c, g), (t, sid)
            n = int(rng.integers(0, g + 1))
            L = len(c)
            c.extend(r.tokens[:n] + [int(rng.integers(0, 256))])
            held[sid] = int(rng.integers(0, L)) if rng.random() < 0.2 else L + min(n, g - 1)
            seq[sid] += 1
            rounds[sid] += 1
            due[sid] = t + 1 + int(rng.integers(0, 3))
        if len(svc.stats.batch_sizes) > before:
            sizes.add(svc.stats.batch_sizes[-1])
        t += 1
        assert t < 400
    assert max(sizes) >= 2                                    # sessions did share steps


def _step(svc):
    out = {}
    step(svc, out)
    return out


def test_star_with_joining_is_lossless_for_three_targets_at_once():
    bus = MemoryBus()
    hub = Hub(link=MemoryLink(bus, "hub"), draft_engine=make_engine(seed=1), tokenizer_fp="tok",
              limits=DraftLimits(join=True)).start()
    results, errors = {}, []
    target = make_engine(seed=0)
    prompts = {f"t{i}": [1 + i, 2, 3 + i, 4] for i in range(3)}

    engines = {n: make_engine(seed=0) for n in prompts}      # not in the threads: one torch seed

    def run(name):
        try:
            eng = engines[name]
            star = StarTarget(eng, HubClient(MemoryLink(bus, name), name, "tok", 256), gamma=3)
            results[name] = star.generate(prompts[name], 24).tokens
        except Exception as e:  # noqa: BLE001 -- reported below
            errors.append(e)
    try:
        threads = [threading.Thread(target=run, args=(n,)) for n in prompts]
        for th in threads:
            th.start()
        for th in threads:
            th.join(120)
        shared = max(int(b) for b in hub.service.stats.snapshot()["step_of_b"])
    finally:
        hub.stop()
    assert not errors, errors
    assert shared >= 2                                        # the targets' requests shared steps
    for name, p in prompts.items():
        assert results[name] == generate_plain(target, p, 24).tokens, name
