"""The draft service alone (no broker): batching, per-session KV, limits, eviction, draft-ahead,
a full context that ends only its own session's drafts."""
import numpy as np
import pytest
import torch

from edge.speculative.generate import generate_plain
from edge.wire.memory_link import MemoryBus, MemoryLink
from edge.wire.protocol import (E_BAD_KEEP, E_OVERLOADED, E_UNKNOWN_SESSION, DraftRequest, DraftResponse,
                           Error, sampling)
from edge.star.draft_limits import DraftRefused
from edge.star.draft_service import DraftLimits, DraftService
from edge.star.hub_client import HubClient, JoinRefused
from edge.star.target import StarTarget
from edge.speculative.sampling import SamplingParams, to_probs, truncate_top_k
from edge.engines.base import EngineError
from edge.engines.torch_engine import TorchEngine
from server.hub import Hub
from harness.draft_services import FakeClock, contexts, make_engine, reference, service, step  # noqa: F401

torch.set_num_threads(1)


def test_one_batch_serves_all_pending_with_one_step_per_position():
    svc, out = service()
    ctxs = contexts(6)
    for i, c in enumerate(ctxs):
        svc.open(f"s{i}")
        svc.submit(DraftRequest(f"s{i}", 1, 0, c, 4))
    assert step(svc, out) == 6
    for i, c in enumerate(ctxs):
        (r,) = out[f"s{i}"]
        assert isinstance(r, DraftResponse) and r.seq == 1 and r.q is None
        assert r.tokens == reference(c, 4)
    s_of_d = svc.stats.snapshot()["s_of_d"]
    assert s_of_d["6"]["batches"] == 1 and s_of_d["6"]["steps"] == 4   # γ batched steps, not 6·γ


def test_keep_and_append_follow_each_session_like_a_fresh_draft():
    """Random acceptance patterns: after every round the drafts equal a fresh
    drafter's on the target's context, with draft-ahead running in between."""
    svc, out = service(DraftLimits(ahead=True))
    rng = np.random.default_rng(5)
    ctxs = contexts(4, seed=8)
    held = {}                       # what the target knows the draft holds (keep bound)
    for i in range(4):
        svc.open(f"s{i}")
        held[f"s{i}"] = 0
    seq = 1
    for rnd in range(6):
        for i, c in enumerate(ctxs):
            sid = f"s{i}"
            svc.submit(DraftRequest(sid, seq, held[sid], c[held[sid]:], 3))
        step(svc, out)
        for _ in range(rnd % 3):
            step(svc, out)                            # nothing pending: one draft-ahead step
        for i, c in enumerate(ctxs):
            sid = f"s{i}"
            r = out[sid][-1]
            assert r.seq == seq and r.tokens == reference(c, 3), (rnd, sid)
            L = len(c)
            n = int(rng.integers(0, 4))               # accept n drafts, then a correction / bonus
            nxt = int(rng.integers(0, 256)) if n < 3 else int(rng.integers(0, 256))
            c.extend(r.tokens[:n] + [nxt])
            held[sid] = L + min(n, 2)                 # the draft fed drafts[:-1]
            if rnd == 3 and i == 0:
                held[sid] = 2                         # a target may always keep less
        seq += 1
    assert svc.stats.snapshot()["batch_size_max"] == 4


def test_refusals_are_clear_errors():
    svc, out = service(DraftLimits(ahead=False, max_gamma=4))
    svc.open("a")
    svc.submit(DraftRequest("a", 1, 0, [1, 2, 3], 2))
    step(svc, out)
    svc.submit(DraftRequest("a", 2, 9, [4], 2))           # the draft holds 4 tokens, not 9
    svc.submit(DraftRequest("nobody", 1, 0, [1], 2))
    step(svc, out)
    err = out["a"][-1]
    assert isinstance(err, Error) and err.code == E_BAD_KEEP and "keep <= 4" in err.message
    assert out["nobody"][-1].code == E_UNKNOWN_SESSION
    svc.submit(DraftRequest("a", 3, 0, [1], 9))
    step(svc, out)
    assert "limit of 4" in out["a"][-1].message
    svc.submit(DraftRequest("a", 3, 0, [1], 2))            # stale seq: ignored
    assert svc.pending() == 0 and svc.stats.counters["stale"] == 1


def test_newer_request_replaces_the_pending_one():
    svc, out = service()
    svc.open("a")
    svc.submit(DraftRequest("a", 1, 0, [1, 2], 2))
    svc.submit(DraftRequest("a", 2, 0, [1, 2, 3], 2))
    assert svc.pending() == 1
    step(svc, out)
    assert [r.seq for r in out["a"]] == [2] and svc.stats.counters["replaced"] == 1


def test_session_and_kv_limits():
    svc, out = service(DraftLimits(ahead=False, max_sessions=2, max_kv_mb=0.1))
    svc.open("a")
    svc.open("b")
    with pytest.raises(DraftRefused, match="limit of 2 sessions"):
        svc.open("c")
    per_token = 2 * 2 * 2 * 16 * 8                             # layers·kv·heads·dim·float64
    svc.submit(DraftRequest("a", 1, 0, list(range(40)), 4))
    step(svc, out)
    assert isinstance(out["a"][-1], DraftResponse)
    # the limit counts what the engine allocates: 64 tokens per sequence at first (edge/model/kv.py)
    assert svc.kv_bytes() == 64 * per_token and 2 * 64 * per_token > 0.1e6
    svc.submit(DraftRequest("b", 1, 0, list(range(10)), 4))
    step(svc, out)
    assert out["b"][-1].code == E_OVERLOADED and "KV memory limit" in out["b"][-1].message


def test_an_engine_that_holds_fewer_sequences_caps_the_sessions():
    """llama.cpp holds n_seq_max sequences: the service refuses the next session at open (and its
    hello says so), instead of failing inside a request. A bye frees the slot for the next one."""
    engine = make_engine()
    engine.capacity = 2
    svc = DraftService(engine, DraftLimits(ahead=False, max_sessions=64))
    assert svc.limits.max_sessions == 2
    svc.open("a")
    svc.open("b")
    with pytest.raises(DraftRefused, match="limit of 2 sessions"):
        svc.open("c")
    assert svc.stats.counters["refused_sessions"] == 1
    svc.close("b")
    svc.open("c")
    assert sorted(svc.sessions()) == ["a", "c"]


def test_bye_and_silence_free_the_kv():
    clock = FakeClock()
    svc, out = service(DraftLimits(ahead=False, evict_after_s=10), clock=clock)
    for sid in ("a", "b"):
        svc.open(sid)
        svc.submit(DraftRequest(sid, 1, 0, [1, 2, 3], 2))
    step(svc, out)
    assert svc.engine.active_sequences == 2
    svc.close("a", "bye")
    step(svc, out)                                             # frees closed sessions' KV
    assert svc.engine.active_sequences == 1
    clock.t = 11
    assert svc.evict_silent() == ["b"]
    step(svc, out)
    assert svc.engine.active_sequences == 0 and svc.sessions() == []


def test_sampling_sends_the_exact_sparse_q_it_sampled_from():
    svc, out = service(DraftLimits(ahead=False, q_top_k=8))
    ctx = [5, 6, 7, 8]
    svc.open("a")
    svc.submit(DraftRequest("a", 1, 0, ctx, 3, sampling(temperature=0.8, seed=1)))
    step(svc, out)
    r = out["a"][-1]
    ref = make_engine(seed=0)
    s = ref.new_sequence()
    logits = ref.forward(s, ctx + r.tokens[:-1])[len(ctx) - 1:]
    params = SamplingParams(temperature=0.8)
    for tok, (idx, pr), row in zip(r.tokens, r.q, logits):
        want = truncate_top_k(to_probs(row, params), 8)
        np.testing.assert_array_equal(idx, want.indices)
        np.testing.assert_allclose(pr, want.probs, rtol=0, atol=1e-12)
        assert tok in idx.tolist()


def test_draft_ahead_answers_a_matching_request_at_once():
    svc, out = service(DraftLimits(ahead=True))
    ctx = [9, 8, 7, 6, 5]
    svc.open("a")
    svc.submit(DraftRequest("a", 1, 0, ctx, 3))
    step(svc, out)
    d = out["a"][-1].tokens
    while svc.has_work():                                      # draft-ahead, to its cap
        step(svc, out)
    bonus = reference(ctx + d, 1)[0]                           # the draft's own guess of the bonus
    svc.submit(DraftRequest("a", 2, len(ctx) + 2, [d[2], bonus], 3))
    step(svc, out)
    st = svc.stats.snapshot()
    assert st["counters"]["ahead_hit"] == 1 and st["s_of_d"]["1"]["steps"] == 3   # no new steps
    assert out["a"][-1].tokens == reference(ctx + d + [bonus], 3)


def test_no_draft_ahead_follows_a_probe():
    """A background request (a target's probe: scored, never verified) is answered as any other,
    and the service then idles: the target decodes on alone past it, so draft-ahead would waste
    the compute (on shared cores, the target's time). A round's request is drafted ahead."""
    ctx = [9, 8, 7, 6, 5]
    for background, ahead in ((True, False), (False, True)):
        svc, out = service(DraftLimits(ahead=True))
        svc.open("a")
        svc.submit(DraftRequest("a", 1, 0, ctx, 3, background=background))
        step(svc, out)
        assert out["a"][-1].tokens == reference(ctx, 3)
        assert svc.has_work() is ahead


class ShortSlots(TorchEngine):
    """Sequences whose slot holds ROOM tokens, fewer than max_len: a step with a sequence past
    its slot fails for the whole batch, as llama_decode does when a KV slot runs out."""
    ROOM = 12

    def step(self, seqs, tokens):
        if any(self.length(s) + 1 > self.ROOM for s in seqs):
            raise EngineError("llama_decode failed (code 1: no KV slot: context full)")
        return super().step(seqs, tokens)


def test_a_full_context_ends_only_that_sessions_drafts():
    """As in the shared decoder: the session out of context is answered with the drafts it
    has, and the others in the batch still get all γ (the whole batch used to stop, empty)."""
    svc, out = service(engine=make_engine(cls=ShortSlots))
    long, short = list(range(1, 11)), [5, 6, 7]
    for sid, ctx in (("long", long), ("short", short)):
        svc.open(sid)
        svc.submit(DraftRequest(sid, 1, 0, ctx, 4))
    assert step(svc, out) == 2
    assert out["long"][-1].tokens == reference(long, 4)[:3]     # the 4th needed a 13th slot
    assert out["short"][-1].tokens == reference(short, 4)
    assert svc.stats.counters["step_refused"] == 1
    d = out["short"][-1].tokens                               # all accepted, then a bonus: goes on
    svc.submit(DraftRequest("short", 2, len(short) + 3, d[3:] + [1], 4))
    assert step(svc, out) == 1 and out["short"][-1].tokens == reference(short + d + [1], 4)


def test_star_on_a_memory_bus_is_lossless_and_refuses_a_foreign_tokenizer():
    bus = MemoryBus()
    hub = Hub(link=MemoryLink(bus, "hub"), draft_engine=make_engine(seed=1), tokenizer_fp="tok-a").start()
    try:
        target = make_engine(seed=0)
        star = StarTarget(target, HubClient(MemoryLink(bus, "t1"), "t1", "tok-a", 256), gamma=3)
        got = star.generate([1, 2, 3, 4], 30)
        assert got.tokens == generate_plain(target, [1, 2, 3, 4], 30).tokens
        assert star.last_drafter.stats.answered > 0
        foreign = StarTarget(target, HubClient(MemoryLink(bus, "t2"), "t2", "tok-b", 256), gamma=3)
        with pytest.raises(JoinRefused, match="tokenizer fingerprint mismatch"):
            foreign.check_join()
        assert hub.counters["refused"] == 1
    finally:
        hub.stop()


def test_sampling_through_the_star_uses_the_wire_q():
    """Stochastic verification against the q that crossed the wire (draft = target: q ≈ p)."""
    bus = MemoryBus()
    hub = Hub(link=MemoryLink(bus, "hub"), draft_engine=make_engine(seed=0), tokenizer_fp="tok",
              limits=DraftLimits(q_top_k=256)).start()
    try:
        star = StarTarget(make_engine(seed=0), HubClient(MemoryLink(bus, "t1"), "t1", "tok", 256), gamma=3)
        out = star.generate([1, 2, 3], 40, SamplingParams(temperature=0.9, seed=3))
        assert len(out.tokens) == 40 and star.last_drafter.stats.errors == 0
        assert out.n_drafted > 0 and out.acceptance_rate > 0.5      # identical models accept almost all
    finally:
        hub.stop()


class _Refeeding(TorchEngine):
    """Short prefills pay to feed 3 held tokens again (as llama.cpp's tiles: Engine.prefill_refeed);
    records the lengths of the forward_last calls (the service's prefills)."""
    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.prefills = []

    def prefill_refeed(self, held: int, new: int) -> int:
        return min(held, 3) if new > 2 else 0

    def forward_last(self, seq, tokens):
        self.prefills.append(len(tokens))
        return super().forward_last(seq, tokens)


def test_a_session_s_next_prompt_feeds_held_tokens_again_where_the_engine_says_it_pays():
    eng = make_engine(cls=_Refeeding)
    svc, out = service(engine=eng)
    first = contexts(1, seed=4)[0] + [5, 6, 7, 8, 9, 10]
    svc.open("a")
    svc.submit(DraftRequest("a", 1, 0, first, 3))
    step(svc, out)
    nxt = first + out["a"][-1].tokens[:2] + [11, 12, 13, 14, 15]       # it holds 2 drafts: 5 new tokens
    svc.submit(DraftRequest("a", 2, len(first), nxt[len(first):], 3))
    step(svc, out)
    assert out["a"][-1].tokens == reference(nxt, 3)                    # the same drafts
    assert eng.prefills[-1] == 3 + 5 - 1           # 3 held tokens again, the new ones but the last
