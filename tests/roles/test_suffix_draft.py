"""The model-free suffix draft: as a local Drafter, as a StarSD service core, and the hybrid
with the model draft -- greedy outputs equal plain decoding exactly (float64 tiny models),
locally and through the star on the memory bus; the fleet tree carries one session's
output to the next."""
import numpy as np
import pytest
import torch

from edge.engines.torch_engine import TorchEngine
from edge.speculative.generate import generate_plain, generate_speculative
from edge.wire.memory_link import MemoryBus, MemoryLink
from edge.wire.protocol import E_BAD_KEEP, E_UNKNOWN_SESSION, DraftRequest, DraftResponse, Error, sampling
from edge.star.draft_service import DraftLimits, DraftService
from edge.star.draft_kinds import make_draft_core
from edge.star.hybrid_service import HybridDraftService
from edge.star.hub_client import HubClient
from edge.star.suffix_service import SuffixDraftService
from edge.star.target import StarTarget
from edge.speculative.sampling import SamplingParams
from edge.speculative.suffix_drafter import SuffixDrafter
from server.hub import Hub

from harness.tiny_models import tiny_model

torch.set_num_threads(1)
TOK = "tok-tiny"
PROMPTS = [[5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6], [1, 2, 3], [40, 41, 42, 40, 41], [7] * 6]


@pytest.fixture(scope="module")
def engines():
    target = tiny_model(0)
    return TorchEngine(target, fingerprint="target"), TorchEngine(tiny_model(1, noise=0.05, base=target), "draft")


def test_local_suffix_drafting_is_lossless_and_learns_across_generations(engines):
    target, _ = engines
    drafter = SuffixDrafter()
    accepted = []
    for p in PROMPTS + PROMPTS:                     # the second pass meets its own earlier outputs
        got = generate_speculative(target, drafter, p, 30, 4)
        assert got.tokens == generate_plain(target, p, 30).tokens, p
        accepted.append(got.n_accepted)
    assert sum(accepted[:4]) > 0
    assert sum(accepted[4:]) > sum(accepted[:4])    # the global tree knew the outputs


def test_local_suffix_drafting_under_sampling_runs_with_point_mass_q(engines):
    target, _ = engines
    got = generate_speculative(target, SuffixDrafter(), PROMPTS[0], 40, 3,
                               SamplingParams(temperature=0.7, seed=1))
    assert len(got.tokens) == 40 and got.n_drafted > 0


def test_the_service_follows_keep_and_append_and_refuses_clearly():
    svc = SuffixDraftService(256, DraftLimits(max_gamma=4))
    svc.open("a")
    svc.submit(DraftRequest("a", 1, 0, [1, 2, 3, 4, 1, 2], 3))
    (sid, r), = svc.step()
    assert isinstance(r, DraftResponse) and r.tokens == [3, 4] and r.q is None
    # the target accepted [3], then corrected to 9: it keeps 6 + 1 (= held up to 3) and appends 9
    svc.submit(DraftRequest("a", 2, 7, [9], 3))
    (_, r), = svc.step()
    assert svc._sessions["a"].ctx.tokens == [1, 2, 3, 4, 1, 2, 3, 9] and isinstance(r, DraftResponse)
    svc.submit(DraftRequest("a", 3, 99, [1], 3))
    svc.submit(DraftRequest("nobody", 1, 0, [1], 2))
    out = dict(svc.step())
    assert out["a"].code == E_BAD_KEEP and "keep <=" in out["a"].message
    assert out["nobody"].code == E_UNKNOWN_SESSION
    svc.submit(DraftRequest("a", 4, 0, [1], 9))
    (_, err), = svc.step()
    assert isinstance(err, Error) and "limit of 4" in err.message
    svc.submit(DraftRequest("a", 4, 0, [1], 2))       # stale seq: ignored
    assert svc.pending() == 0 and svc.stats.counters["stale"] == 1


def test_under_sampling_the_service_sends_point_masses():
    svc = SuffixDraftService(256)
    svc.open("a")
    svc.submit(DraftRequest("a", 1, 0, [1, 2, 3, 1, 2], 2, sampling(temperature=0.8, seed=3)))
    (_, r), = svc.step()
    assert r.tokens == [3, 1]
    assert [(i.tolist(), p.tolist()) for i, p in r.q] == [([3], [1.0]), ([1], [1.0])]


def star(bus, core, client="t1", gamma=3):
    return StarTarget(TorchEngine(tiny_model(0), "target"),
                      HubClient(MemoryLink(bus, client), client, TOK, 256), gamma=gamma)


@pytest.mark.parametrize("kind", ["suffix", "hybrid"])
def test_the_star_with_a_suffix_or_hybrid_draft_is_lossless(engines, kind):
    target, draft = engines
    bus = MemoryBus()
    core = make_draft_core(kind, draft if kind == "hybrid" else None, DraftLimits(ahead=False),
                           name="hub-draft", vocab_size=256)
    hub = Hub(link=MemoryLink(bus, "hub"), draft_core=core, tokenizer_fp=TOK, status_every=60.0).start()
    try:
        s = star(bus, core)
        for p in PROMPTS:
            got = s.generate(p, 30)
            assert got.tokens == generate_plain(target, p, 30).tokens, (kind, p)
        assert s.last_drafter.stats.answered > 0
        c = hub.service.stats.snapshot()["counters"]
        if kind == "hybrid":                     # both halves answered some rounds
            assert c.get("hybrid_suffix", 0) > 0 and c.get("hybrid_model", 0) > 0, c
        s.hub.link.close()
    finally:
        hub.stop()


def test_the_fleet_tree_carries_one_sessions_output_to_another(engines):
    target, _ = engines
    bus = MemoryBus()
    core = SuffixDraftService(256, DraftLimits(), name="hub-draft")
    hub = Hub(link=MemoryLink(bus, "hub"), draft_core=core, tokenizer_fp=TOK, status_every=60.0).start()
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    try:
        first, second = star(bus, core, "t1"), star(bus, core, "t2")
        a = first.generate(prompt, 40)
        b = second.generate(prompt, 40)                # another device, the same question
        assert a.tokens == b.tokens == generate_plain(target, prompt, 40).tokens
        assert core.stats.counters.get("proposed_global", 0) > 0
        assert b.n_accepted > a.n_accepted, (a.n_accepted, b.n_accepted)
        for s in (first, second):
            s.hub.link.close()
    finally:
        hub.stop()


def _replies(svc, most=50):
    """Step until the service replies (a joining model answers over several steps)."""
    for _ in range(most):
        out = svc.step()
        if out:
            return out
    raise AssertionError(f"no reply in {most} steps")


@pytest.mark.parametrize("join", [False, True], ids=["whole-batches", "joining"])
@pytest.mark.parametrize("idle", [False, True])
def test_hybrid_keeps_the_models_keep_consistent_after_suffix_answers(engines, idle, join):
    """Random acceptance patterns: every model answer equals a fresh model draft on the
    target's context, whatever the suffix half answered in between (idle: with the idle
    steps between requests, where the model catches up, which must send nothing; joining:
    the model answers a few steps later, as `edge-hub serve` runs it by default)."""
    _, draft = engines
    from edge.speculative.generate import ModelDrafter
    svc = HybridDraftService(DraftService(draft, DraftLimits(ahead=True, join=join)), min_score=1.0)
    svc.open("a")
    rng = np.random.default_rng(4)
    ctx, held, used = [5, 6, 7, 5, 6, 7, 5], 0, set()
    for seq in range(1, 25):
        asked = svc.stats.counters.get("hybrid_model", 0)
        svc.submit(DraftRequest("a", seq, held, ctx[held:], 3))
        (_, r), = _replies(svc)
        assert isinstance(r, DraftResponse) and r.seq == seq
        if svc.stats.counters.get("hybrid_model", 0) > asked:
            used.add("model")
            assert r.tokens == ModelDrafter(draft).draft(ctx, 3, np.random.default_rng(0))[0], seq
        else:
            used.add("suffix")
        for _ in range(3 if idle else 0):
            assert svc.step() == []
        n = int(rng.integers(0, len(r.tokens) + 1))           # accept n, then a correction
        L = len(ctx)
        ctx = ctx + r.tokens[:n] + [int(rng.integers(0, 12))]
        held = L + min(n, max(0, len(r.tokens) - 1))          # the draft holds T + drafts[:-1]
    assert used == {"model", "suffix"}


def test_hybrid_catches_the_model_up_in_idle_time_after_a_suffix_answered_prompt(engines):
    """A prompt the suffix answered (a fleet tree that knows how answers open) must not leave
    the model a prefill to pay inside a later round: the next idle step feeds it, sends nothing."""
    _, draft = engines
    from edge.speculative.generate import ModelDrafter
    svc = HybridDraftService(DraftService(draft, DraftLimits(ahead=False)), min_score=0.0)
    svc.open("a")
    prompt = [5, 6, 7, 8, 9] * 4 + [5, 6]
    svc.submit(DraftRequest("a", 1, 0, prompt, 3))
    (_, r), = svc.step()
    assert svc.stats.counters["hybrid_suffix"] == 1 and r.tokens == [7, 8, 9]
    model = svc.model._sessions["a"]
    assert model.fed == []                                # the model has not seen the prompt
    assert svc.has_work() and svc.step() == []            # idle: the catch-up
    assert svc.stats.counters["hybrid_sync"] == 1 and model.fed == prompt
    assert not svc.has_work()
    ctx = prompt + [7, 11]                                # accepted 7, corrected to 11: nothing to copy
    svc.submit(DraftRequest("a", 2, len(prompt) + 1, [11], 3))
    (_, r), = svc.step()
    assert svc.stats.counters["hybrid_model"] == 1 and isinstance(r, DraftResponse) and r.seq == 2
    assert r.tokens == ModelDrafter(draft).draft(ctx, 3, np.random.default_rng(0))[0]
    assert svc.stats.counters["hybrid_sync"] == 1         # caught up already: no second catch-up


def _hybrid(draft, sid="a"):
    svc = HybridDraftService(DraftService(draft, DraftLimits(ahead=False)), min_score=0.5)
    svc.open(sid)
    return svc


def _suffix_rejected_then_model_kept(svc):
    """Session "a": a suffix guess the target rejected, then a model answer it kept whole, then a
    request whose suffix proposal a fresh service would send; the context of that request."""
    P = [5, 6, 7, 8, 9, 5, 6]
    svc.submit(DraftRequest("a", 1, 0, P, 3))
    (_, r), = svc.step()
    assert svc.stats.counters.get("hybrid_suffix") == 1 and r.tokens[:2] == [7, 8]
    svc.submit(DraftRequest("a", 2, len(P), [11], 3))          # all rejected, corrected to 11
    (_, d1), = svc.step()
    assert svc.stats.counters.get("hybrid_model") == 1 and len(d1.tokens) == 3
    ctx = P + [11] + d1.tokens + [5, 6]                        # all kept, then plain steps to "5, 6"
    held = len(P) + 1 + len(d1.tokens) - 1
    svc.submit(DraftRequest("a", 3, held, ctx[held:], 3))
    svc.step()
    return ctx


def test_hybrid_asks_the_model_where_its_answers_kept_more_than_the_suffixs(engines):
    """The source follows what each one's answers kept this session: after a suffix guess the
    target rejected and a model answer it kept whole, a suffix proposal that a fresh service
    would send goes to the model."""
    _, draft = engines
    svc = _hybrid(draft)
    ctx = _suffix_rejected_then_model_kept(svc)
    assert svc.stats.counters.get("hybrid_model") == 2, svc.stats.counters
    fresh = _hybrid(draft)
    fresh.submit(DraftRequest("a", 1, 0, ctx, 3))
    fresh.step()
    assert fresh.stats.counters.get("hybrid_suffix") == 1 and "hybrid_model" not in fresh.stats.counters


def test_a_new_hybrid_session_starts_from_what_the_fleets_answers_kept(engines):
    """A new session's first answers are decided by the fleet's yields, not from nothing: after
    session "a" learned that the model's answers keep more, session "b"'s first request, whose
    suffix proposal a fresh service would send, goes to the model."""
    _, draft = engines
    svc = _hybrid(draft)
    ctx = _suffix_rejected_then_model_kept(svc)
    svc.open("b")
    svc.submit(DraftRequest("b", 1, 0, ctx, 3))
    (_, r), = svc.step()
    assert isinstance(r, DraftResponse) and r.sid == "b"
    assert svc.stats.counters.get("hybrid_model") == 3 and svc.stats.counters.get("hybrid_suffix") == 1
