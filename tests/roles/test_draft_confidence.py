"""The draft service's confidence stop (DraftLimits.p_min): an answer ends before a draft the
draft model gives less than p_min and the request drafts no further; draft-ahead runs past it
in idle time, so a target that continues through it is answered from the same chain.
The sampling case is measured in tests/roles/test_seed_streams.py (chi-square)."""
import numpy as np
import pytest

from edge.speculative.generate import generate_plain
from edge.wire.memory_link import MemoryBus, MemoryLink
from edge.wire.protocol import DraftRequest, DraftResponse
from edge.speculative.remote_gamma import RemoteGamma
from edge.star.draft_service import DraftLimits, DraftService
from edge.star.hub_client import HubClient
from edge.star.target import StarTarget
from server.hub import Hub

from harness.draft_services import make_engine, reference, step


def greedy_path(ctx, n, seed=0):
    """The draft's greedy tokens after ctx and its top probability at each (float64)."""
    eng = make_engine(seed=seed)
    toks = reference(ctx, n, seed)
    logits = eng.forward(eng.new_sequence(), ctx + toks[:-1])[len(ctx) - 1:]
    z = logits - logits.max(axis=1, keepdims=True)
    top = 1.0 / np.exp(z).sum(axis=1)
    return toks, top.tolist()


def cut_for(top):
    """A p_min that keeps the first drafts and stops at a later one: (p_min, tokens kept)."""
    for j in range(1, len(top)):
        if top[j] < min(top[:j]):
            return (top[j] + min(top[:j])) / 2, j
    raise AssertionError(f"the fixture's greedy probabilities never fall below an earlier one: {top}")


def test_an_answer_stops_before_an_unsure_draft_and_ahead_runs_past_it():
    ctx = [9, 8, 7, 6, 5]
    toks, top = greedy_path(ctx, 8)
    p_min, j = cut_for(top)
    svc = DraftService(make_engine(), DraftLimits(ahead=True, p_min=p_min))
    out = {}
    svc.open("a")
    svc.submit(DraftRequest("a", 1, 0, ctx, 8))
    step(svc, out)
    r = out["a"][-1]
    assert isinstance(r, DraftResponse) and r.tokens == toks[:j]        # the unsure one is not sent
    st = svc.stats.snapshot()
    assert st["counters"]["unsure_stops"] == 1
    assert st["s_of_d"]["1"]["steps"] == j + 1                          # ... nor drafted past, for the answer
    while svc.has_work():                                                # idle: draft-ahead goes on past it
        step(svc, out)
    assert svc.stats.snapshot()["ahead_tokens"] > 0
    # the target accepted them all and its own next token is the one the draft was unsure of:
    # the answer is ready from the chain, exactly what a fresh draft would send
    svc.submit(DraftRequest("a", 2, len(ctx), toks[:j + 1], 3))
    step(svc, out)
    assert svc.stats.snapshot()["counters"].get("ahead_hit") == 1
    want, wtop = greedy_path(ctx + toks[:j + 1], 3)
    sure = next((i for i, p in enumerate(wtop) if p < p_min), 3)
    assert out["a"][-1].tokens == want[:sure]


def test_p_min_zero_always_drafts_gamma_and_bad_values_are_refused():
    svc = DraftService(make_engine(), DraftLimits(ahead=False))
    out = {}
    svc.open("a")
    svc.submit(DraftRequest("a", 1, 0, [1, 2, 3], 6))
    step(svc, out)
    assert out["a"][-1].tokens == reference([1, 2, 3], 6)
    for bad in (-0.1, 1.0, 2.0):
        with pytest.raises(ValueError, match="p_min must be in"):
            DraftLimits(p_min=bad)


def test_star_with_confidence_stops_is_lossless_greedy():
    """Drafts cut short at many rounds (a high p_min on a tiny model): the target's greedy text."""
    bus = MemoryBus()
    hub = Hub(link=MemoryLink(bus, "hub"), draft_engine=make_engine(seed=1), tokenizer_fp="tok",
              limits=DraftLimits(p_min=0.3)).start()
    try:
        target = make_engine(seed=0)
        star = StarTarget(target, HubClient(MemoryLink(bus, "t1"), "t1", "tok", 256), gamma=4)
        for prompt in ([1, 2, 3, 4], [7, 7, 7], [200, 3, 90, 41, 5]):
            got = star.generate(prompt, 30)
            assert got.tokens == generate_plain(target, prompt, 30).tokens
        assert hub.service.stats.snapshot()["counters"].get("unsure_stops", 0) > 0
    finally:
        hub.stop()


def test_a_requests_looser_p_min_wins_a_stricter_one_does_not():
    """The target sends the stop that suits its verify cost (DraftRequest.p_min): a service with
    a strict stop sends every draft to a request that asks for p_min 0 and cuts where a looser
    request says; a request never makes the service stricter; without one, the service's."""
    ctx = [9, 8, 7, 6, 5]
    toks, top = greedy_path(ctx, 8)
    p_min, j = cut_for(top)
    for service_p, request_p, sent in ((0.999, 0.0, 8), (0.999, p_min, j), (0.0, p_min, 8), (p_min, None, j),
                                       (0.0, None, 8)):
        svc = DraftService(make_engine(), DraftLimits(ahead=False, p_min=service_p))
        out = {}
        svc.open("a")
        svc.submit(DraftRequest("a", 1, 0, ctx, 8, p_min=request_p))
        step(svc, out)
        assert out["a"][-1].tokens == toks[:sent], (service_p, request_p)


def test_star_with_the_targets_own_stop_is_lossless_greedy():
    """γ=auto sends its p_min with every request (edge/speculative/remote_gamma.py RemoteGamma.p_min); a
    service whose own stop is strict still answers it, and the text is the target's."""
    bus = MemoryBus()
    hub = Hub(link=MemoryLink(bus, "hub"), draft_engine=make_engine(seed=1), tokenizer_fp="tok",
              limits=DraftLimits(p_min=0.9)).start()
    try:
        target = make_engine(seed=0)
        star = StarTarget(target, HubClient(MemoryLink(bus, "t1"), "t1", "tok", 256), gamma=4, adaptive=True)
        asked = []
        real = hub.service.submit
        hub.service.submit = lambda req, *a, **k: (asked.append(req.p_min), real(req, *a, **k))[1]
        for prompt in ([1, 2, 3, 4], [7, 7, 7], [200, 3, 90, 41, 5]):
            got = star.generate(prompt, 30)
            assert got.tokens == generate_plain(target, prompt, 30).tokens
        assert asked and all(p is not None and 0.0 <= p <= RemoteGamma.MAX_P_MIN for p in asked)
    finally:
        hub.stop()
