"""The reverse star (#46): devices draft, the hub's verify service verifies every device's drafts in
one batched call. Lossless exactly as StarSD: greedy output equals the target alone (tiny float64
models), sampled output passes the chi-square test against the exactly enumerated target
distribution (harness/goodness_of_fit.py, the same harness as tests/roles/test_seed_streams.py),
with a shared-stream negative control; seeded generations replay; the hub's KV is rolled back on
rejection; a restarted hub loses no token; a hub that is gone is HubUnavailable, never draft text.
"""

import numpy as np
import pytest
import torch

import edge.star.drafting_device as device_mod
import edge.star.verify_service as verify_mod
from edge.engines.torch_engine import TorchEngine
from edge.speculative.generate import generate_plain
from edge.speculative.sampling import SamplingParams
from edge.star.draft_limits import DraftLimits
from edge.star.drafting_device import DraftingDevice, HubUnavailable
from edge.star.hub_client import HubClient
from edge.star.verify_service import VerifyService
from edge.wire.memory_link import MemoryBus, MemoryLink
from edge.wire.protocol import Error, VerifyRequest, VerifyResponse, sampling
from server.hub import Hub

from harness.at_once import all_at_once
from harness.goodness_of_fit import TableEngine, chi_square, critical_value, exact_distribution
from harness.counting_engine import CountingEngine
from harness.tiny_models import target_and_draft

torch.set_num_threads(1)
TOK = "tok-tiny"


@pytest.fixture(scope="module")
def models():
    return target_and_draft()


def device(bus, name, engine, fp=TOK, vocab=256, **kw):
    return DraftingDevice(engine, HubClient(MemoryLink(bus, name), name, fp, vocab, role="drafter"), **kw)


def prompt(i):
    return [(7 * i + j * 13) % 256 for j in range(3 + i % 5)]


# ---------------------------------------------------------------- the core

def test_one_batched_call_verifies_every_pending_session(models):
    eng = CountingEngine(models[0], fingerprint="target")
    svc = VerifyService(eng)
    plain = [generate_plain(TorchEngine(models[0], fingerprint="t"), prompt(i), 1).tokens[0] for i in range(3)]
    for i in range(3):
        svc.open(f"s{i}")
        # drafts: the target's own next token, then a wrong one
        svc.submit(VerifyRequest(f"s{i}", 1, 0, prompt(i), [plain[i], (plain[i] + 1) % 256]))
    replies = dict(svc.step())
    assert eng.batches == [3]                           # the three sessions in ONE call
    for i in range(3):
        r = replies[f"s{i}"]
        assert isinstance(r, VerifyResponse) and r.n_accepted >= 1 and r.batch == 3
        assert r.held == len(prompt(i)) + r.n_accepted + 1
        s = svc._sessions[f"s{i}"]
        # the rejected draft's KV is rolled back: the target holds exactly committed[:-1]
        assert eng.tokens(s.seq) == s.committed[:-1] and len(s.committed) == r.held


def test_refusals_name_what_to_do(models):
    svc = VerifyService(TorchEngine(models[0], fingerprint="target"), DraftLimits(max_gamma=2, ahead=False))
    svc.open("a")
    svc.submit(VerifyRequest("a", 1, 5, [1, 2], [3]))
    svc.submit(VerifyRequest("zz", 1, 0, [1, 2], [3]))
    out = dict(svc.step())
    assert isinstance(out["a"], Error) and out["a"].code == "bad_keep" and "keep <= 0" in out["a"].message
    assert isinstance(out["zz"], Error) and out["zz"].code == "unknown_session"
    svc.submit(VerifyRequest("a", 2, 0, [1, 2], [3, 4, 5]))
    (sid, err), = svc.step()
    assert err.code == "bad_request" and "limit of 2" in err.message
    svc.submit(VerifyRequest("a", 3, 0, list(range(1, 200)) * 3, [3]))
    (sid, err), = svc.step()
    assert err.code == "context_full"


def test_drafts_past_the_context_are_cut_not_refused(models):
    eng = TorchEngine(models[0], fingerprint="target")
    svc = VerifyService(eng)
    svc.open("a")
    ctx = [1 + i % 200 for i in range(eng.max_len - 1)]
    svc.submit(VerifyRequest("a", 1, 0, ctx, [5, 6, 7]))
    (_, r), = svc.step()
    assert isinstance(r, VerifyResponse) and r.n_accepted <= 1 and r.held <= eng.max_len + 1


# ---------------------------------------------------------------- greedy through the hub

def test_greedy_devices_equal_the_target_alone(models):
    target, draft = models
    bus = MemoryBus()
    hub = Hub(link=MemoryLink(bus, "hub"), verify_engine=TorchEngine(target, fingerprint="target"),
              tokenizer_fp=TOK, status_every=60.0).start()
    devs = [device(bus, f"d{i}", TorchEngine(draft, fingerprint="draft"), gamma=3) for i in range(4)]
    try:
        got = all_at_once([lambda i=i: devs[i].generate(prompt(i), 24) for i in range(4)])
        for i in range(4):
            want = generate_plain(TorchEngine(target, fingerprint="t"), prompt(i), 24).tokens
            assert got[i].tokens == want, f"device {i} differs from the target's own greedy output"
            assert got[i].n_accepted > 0
        # a second prompt on a kept session: the hub keeps the prefix it shares, still exact
        again = devs[0].generate(prompt(0) + [9, 9], 16)
        assert again.tokens == generate_plain(TorchEngine(target, fingerprint="t"), prompt(0) + [9, 9], 16).tokens
        snap = hub.snapshot()["verify"]
        assert snap["requests"] >= sum(g.n_verify_calls for g in got) and snap["acceptance"] > 0
    finally:
        for d in devs:
            d.close()
        hub.stop()


def test_auto_gamma_stays_exact(models):
    target, draft = models
    bus = MemoryBus()
    hub = Hub(link=MemoryLink(bus, "hub"), verify_engine=TorchEngine(target, fingerprint="target"),
              tokenizer_fp=TOK, status_every=60.0).start()
    dev = device(bus, "auto", TorchEngine(draft, fingerprint="draft"), gamma=8, adaptive=True)
    try:
        r = dev.generate(prompt(3), 40)
        assert r.tokens == generate_plain(TorchEngine(target, fingerprint="t"), prompt(3), 40).tokens
        assert max(r.gammas) <= 8 and dev.last_gamma.costs.has_draft
    finally:
        dev.close()
        hub.stop()


def test_a_hub_that_restarts_mid_generation_loses_no_token(models):
    """The hub dies after a few rounds and a new one (new epoch, empty registry) comes up: the
    device rejoins and resends its committed text; the output is still the target's alone."""
    target, draft = models
    bus = MemoryBus()
    hubs = [Hub(link=MemoryLink(bus, "hub"), verify_engine=TorchEngine(target, fingerprint="target"),
                tokenizer_fp=TOK, status_every=60.0).start()]
    dev = device(bus, "d", TorchEngine(draft, fingerprint="draft"), gamma=2, answer_timeout=30.0,
                 resend_after=0.5)
    seen = []

    def on_token(t):
        seen.append(t)
        if len(seen) == 6:                              # mid-generation: the hub is killed, another starts
            hubs[0].kill()
            hubs.append(Hub(link=MemoryLink(bus, "hub2"), verify_engine=TorchEngine(target, fingerprint="target"),
                            tokenizer_fp=TOK, status_every=60.0).start())
    try:
        r = dev.generate(prompt(2), 20, on_token=on_token)
        assert r.tokens == seen == generate_plain(TorchEngine(target, fingerprint="t"), prompt(2), 20).tokens
        assert dev.counts["rejoined"] >= 1
    finally:
        dev.close()
        hubs[-1].stop()


def test_no_hub_is_hub_unavailable_and_no_text(models):
    bus = MemoryBus()
    dev = device(bus, "alone", TorchEngine(models[1], fingerprint="draft"), join_timeout=0.2)
    out = []
    with pytest.raises(HubUnavailable, match="unreachable"):
        dev.generate(prompt(1), 8, on_token=out.append)
    assert out == []


def test_a_hub_without_a_verify_service_refuses_drafters(models):
    bus = MemoryBus()
    hub = Hub(link=MemoryLink(bus, "hub"), draft_engine=TorchEngine(models[1], fingerprint="draft"),
              tokenizer_fp=TOK, status_every=60.0).start()
    dev = device(bus, "d", TorchEngine(models[1], fingerprint="draft"))
    try:
        with pytest.raises(HubUnavailable, match="no verify service.*--verify-model"):
            dev.generate(prompt(1), 8)
    finally:
        hub.stop()


# ---------------------------------------------------------------- sampled: chi-square

PROMPT = [1, 3, 0]
HOT = SamplingParams(temperature=1.0)
N = 6000


def shared_stream(monkeypatch):
    """The bug: the device's draft and the hub's target seed their generators with the bare seed."""
    bare = lambda seed, role, *extra: np.random.default_rng(seed)  # noqa: E731
    for mod in (device_mod, verify_mod):
        monkeypatch.setattr(mod, "role_rng", bare)


def reverse_fit(n, q_top_k, length=3, gamma=2):
    """n seeded generations of a drafting device through a hub's verify service -> (chi2, df, crit, acc)."""
    target, draft = TableEngine(vocab=4, seed=1), TableEngine(vocab=4, seed=7)
    bus = MemoryBus()
    hub = Hub(link=MemoryLink(bus, "hub"), verify_engine=target, tokenizer_fp="tok-table", status_every=60.0).start()
    dev = device(bus, "d", draft, fp="tok-table", vocab=4, gamma=gamma, q_top_k=q_top_k, answer_timeout=30.0,
                 resend_after=5.0)
    counts, drafted, accepted = {}, 0, 0
    try:
        for i in range(n):
            r = dev.generate(PROMPT, length, SamplingParams(temperature=1.0, seed=20_000 + i))
            assert r.n_generated == length
            counts[tuple(r.tokens)] = counts.get(tuple(r.tokens), 0) + 1
            drafted, accepted = drafted + r.n_drafted, accepted + r.n_accepted
    finally:
        dev.close()
        hub.stop()
    stat, df = chi_square(counts, exact_distribution(target, PROMPT, length, HOT), n)
    return stat, df, critical_value(df), (accepted, drafted)


@pytest.mark.parametrize("q_top_k", [4, 2], ids=["dense-q", "sparse-top2-q"])
def test_sampled_reverse_star_is_lossless(q_top_k):
    stat, df, crit, (acc, drafted) = reverse_fit(N, q_top_k)
    print(f"reverse q_top_k={q_top_k}: chi2={stat:.1f} df={df} crit={crit:.1f} {acc}/{drafted}")
    assert drafted >= N and 0.2 < acc / drafted < 0.8, (acc, drafted)
    assert df >= 30, df
    assert stat < crit, f"chi2={stat:.1f} >= {crit:.1f} (df={df}): reverse-star sampling is not lossless"


def test_negative_control_shared_stream_fails(monkeypatch):
    shared_stream(monkeypatch)
    stat, df, crit, _ = reverse_fit(N // 3, 4)
    print(f"reverse shared stream: chi2={stat:.1f} df={df} crit={crit:.1f}")
    assert stat > crit, f"the shared stream passed (chi2={stat:.1f} < {crit:.1f}): the test has no power"


def test_a_seeded_generation_replays():
    target, draft = TableEngine(vocab=5, seed=3), TableEngine(vocab=5, seed=4)
    bus = MemoryBus()
    hub = Hub(link=MemoryLink(bus, "hub"), verify_engine=target, tokenizer_fp="tok-table", status_every=60.0).start()
    dev = device(bus, "d", draft, fp="tok-table", vocab=5, gamma=3)
    try:
        p = SamplingParams(temperature=1.0, seed=77)
        runs = [dev.generate(PROMPT, 12, p).tokens for _ in range(3)]
        other = dev.generate(PROMPT, 12, SamplingParams(temperature=1.0, seed=78)).tokens
    finally:
        dev.close()
        hub.stop()
    assert runs[0] == runs[1] == runs[2] and other != runs[0]


def test_wire_refuses_inconsistent_requests():
    from edge.wire.protocol import ProtocolError, decode, encode
    key = b"k" * 32
    with pytest.raises(ProtocolError, match="carries the q"):
        encode(VerifyRequest("a", 1, 0, [1], [2], None, sampling(temperature=1.0)), key)
    with pytest.raises(ProtocolError, match="greedy request carries no q"):
        encode(VerifyRequest("a", 1, 0, [1], [2], [(np.array([2]), np.array([1.0]))]), key)
    with pytest.raises(ProtocolError, match="names no context"):
        encode(VerifyRequest("a", 1, 0, [], [2]), key)
    with pytest.raises(ProtocolError):                  # more drafts than MAX_GAMMA
        encode(VerifyRequest("a", 1, 0, [1], [2] * 33), key)
    msg = decode(encode(VerifyResponse("a", 4, 2, 7, 10, 5, 3), key), key)
    assert (msg.n_accepted, msg.token, msg.held, msg.batch) == (2, 7, 10, 3)


def test_an_answer_to_an_earlier_copy_of_a_request_is_taken(models):
    """A hub slower than the resend interval answers the copies in turn: the answer to any copy of
    the round's request ends the wait (else each answer would come for a copy already superseded)."""
    from edge.star.hub_client import Session
    from edge.wire.protocol import Joined, down_topic, up_topic

    class _Hub:
        link = None
    j = Joined("c", True, "", "s", b"k" * 32, "v", up_topic("c", "s", "v"), down_topic("c", "s", "v"))
    s = Session(_Hub(), j, None)
    s._deliver(VerifyResponse("s", 1, 0, 5, 3))
    msg, _ = s.wait_any({1, 2, 3}, until=0.0)             # answered already: no wait at all
    assert msg.seq == 1 and s.wait_any({1, 2}, until=0.0) is None
    # through a hub, resending every millisecond: still the target's own text
    target, draft = models
    bus = MemoryBus()
    hub = Hub(link=MemoryLink(bus, "hub"), verify_engine=TorchEngine(target, fingerprint="target"),
              tokenizer_fp=TOK, status_every=60.0).start()
    dev = device(bus, "eager", TorchEngine(draft, fingerprint="draft"), gamma=3, resend_after=0.001)
    try:
        r = dev.generate(prompt(4), 20)
        assert r.tokens == generate_plain(TorchEngine(target, fingerprint="t"), prompt(4), 20).tokens
    finally:
        dev.close()
        hub.stop()


def test_a_model_free_drafter_is_verified_exactly_too():
    """Any Drafter may propose (drafter_of): an n-gram one sends no q, verified against one-hot q --
    greedy the target's text, sampled still the target's distribution (a deterministic proposal)."""
    from edge.speculative.ngram import NgramDrafter
    target = TableEngine(vocab=4, seed=1)
    bus = MemoryBus()
    hub = Hub(link=MemoryLink(bus, "hub"), verify_engine=target, tokenizer_fp="tok-table", status_every=60.0).start()
    dev = device(bus, "ngram", TableEngine(vocab=4, seed=7), fp="tok-table", vocab=4, gamma=3,
                 drafter_of=lambda params, k: NgramDrafter())
    try:
        r = dev.generate(PROMPT * 3, 12)
        assert r.tokens == generate_plain(TableEngine(vocab=4, seed=1), PROMPT * 3, 12).tokens and r.n_drafted > 0
        counts = {}
        for i in range(3000):
            s = dev.generate(PROMPT, 3, SamplingParams(temperature=1.0, seed=i)).tokens
            counts[tuple(s)] = counts.get(tuple(s), 0) + 1
    finally:
        dev.close()
        hub.stop()
    stat, df = chi_square(counts, exact_distribution(target, PROMPT, 3, HOT), 3000)
    assert stat < critical_value(df), (stat, df)


def test_a_q_that_is_not_a_distribution_is_refused_and_the_service_goes_on(models):
    """The wire lets a q summing to 1 within 1e-3 through; the verify math needs 1e-6: such a request
    is answered bad_request, and the next one of the same session is served."""
    svc = VerifyService(TorchEngine(models[0], fingerprint="target"))
    svc.open("a")
    q = [(np.array([5, 6]), np.array([0.6, 0.3995]))]
    svc.submit(VerifyRequest("a", 1, 0, [1, 2, 3], [5], q, sampling(temperature=1.0, seed=1), True))
    (_, err), = svc.step()
    assert isinstance(err, Error) and err.code == "bad_request" and "sum to 1" in err.message
    svc.submit(VerifyRequest("a", 2, 0, [1, 2, 3], [5], [(np.array([5, 6]), np.array([0.6, 0.4]))],
                             sampling(temperature=1.0, seed=1), True))
    (_, ok), = svc.step()
    assert isinstance(ok, VerifyResponse) and ok.held == 3 + ok.n_accepted + 1


def test_a_copy_verified_twice_cannot_desynchronise_the_session(models):
    """A resent copy of a request that the service serves after its first copy: sampled, the second
    verdict may differ from the one the device took. The device's next request names its round's
    tokens itself (keep = the context before, append = what it committed), so the service verifies
    the next drafts after exactly the device's text, whatever it did with the copy."""
    svc = VerifyService(TorchEngine(models[0], fingerprint="target"))
    svc.open("a")
    hot = sampling(temperature=5.0, seed=3)                  # flat: the copies' verdicts differ
    q = [(np.array([5]), np.array([1.0])), (np.array([6]), np.array([1.0]))]
    verdicts = []
    for seq in (1, 2, 3, 4, 5, 6):                           # copies of one request, served one by one
        svc.submit(VerifyRequest("a", seq, 0, [1, 2, 3], [5, 6], q, hot, seq == 1))
        verdicts.append(svc.step()[0][1])
    took = verdicts[0]                                       # what the device committed
    assert {(v.n_accepted, v.token) for v in verdicts} != {(took.n_accepted, took.token)}
    mine = [5, 6][:took.n_accepted] + [took.token]
    svc.submit(VerifyRequest("a", 7, 3, mine, [], None, hot))
    (_, r), = svc.step()
    assert isinstance(r, VerifyResponse) and r.held == 3 + len(mine) + 1
    assert svc._sessions["a"].committed[:3 + len(mine)] == [1, 2, 3] + mine
