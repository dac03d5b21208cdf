"""edge/speculative/verify.py, edge/speculative/ngram.py and edge/speculative/generate.py: verification, cost
model, prompt lookup, and speculative == plain greedy output."""
import time

import numpy as np
import pytest

from edge.engines.base import EngineError
from edge.speculative.drafter import Drafter
from edge.speculative.local_gamma import AdaptiveGamma
from edge.speculative.generate import ModelDrafter, generate_plain, generate_speculative
from edge.speculative.ngram import NgramDrafter
from edge.speculative.sampling import SamplingParams, SparseDist
from edge.speculative.verify import (AcceptanceTracker, CostTracker, choose_gamma, expected_tokens,
                              predicted_speedup, verify_greedy, verify_stochastic)
from harness.table_engine import TableEngine

GREEDY = SamplingParams()


def one_hot_logits(ids, vocab=6):
    out = np.zeros((len(ids), vocab))
    out[np.arange(len(ids)), ids] = 5.0
    return out


# ---------------------------------------------------------------- verification

def test_verify_greedy_hand_cases():
    logits = one_hot_logits([3, 1, 4, 2])
    assert verify_greedy([3, 1, 4], logits) == (3, 2)     # all accepted + bonus
    assert verify_greedy([0, 1, 4], logits) == (0, 3)     # first rejected -> correction
    assert verify_greedy([3, 1, 5], logits) == (2, 4)
    assert verify_greedy([], logits[:1]) == (0, 3)        # gamma 0 is a plain step
    with pytest.raises(ValueError, match=r"gamma\+1"):
        verify_greedy([3, 1], logits)
    with pytest.raises(ValueError, match="outside"):
        verify_greedy([9], logits[:2])


def test_verify_stochastic_deterministic_cases():
    rng = np.random.default_rng(0)
    p = np.eye(4)[[2, 1, 3]]                 # target certain of 2, 1, then 3
    assert verify_stochastic([2, 1], [np.eye(4)[2], np.eye(4)[1]], p, rng) == (2, 3)
    # draft certain of a token the target never emits -> rejected, residual = p
    assert verify_stochastic([0, 1], [np.eye(4)[0], np.eye(4)[1]], p, rng) == (0, 2)
    assert verify_stochastic([2, 0], [SparseDist.one_hot(2), SparseDist.one_hot(0)], p, rng) == (1, 1)
    # p == q: always accepted whatever it is
    u = np.full((2, 4), 0.25)
    for _ in range(50):
        assert verify_stochastic([int(rng.integers(4))], [u[0]], u, rng)[0] == 1


def test_verify_stochastic_errors():
    rng = np.random.default_rng(0)
    p = np.full((2, 4), 0.25)
    with pytest.raises(ValueError, match="sampled from"):   # q(x) = 0 for a sampled x
        verify_stochastic([1], [np.array([1.0, 0, 0, 0])], p, rng)
    with pytest.raises(ValueError, match="sampled from"):
        verify_stochastic([1], [SparseDist.one_hot(2)], p, rng)
    with pytest.raises(ValueError, match="one draft distribution"):
        verify_stochastic([1], [], p, rng)
    with pytest.raises(ValueError, match="vocabulary"):
        verify_stochastic([1], [np.full(5, 0.2)], p, rng)
    with pytest.raises(ValueError, match="vocabulary"):
        verify_stochastic([1], [SparseDist(np.array([1, 9]), np.array([0.5, 0.5]))], p, rng)


def test_verify_stochastic_first_token_follows_p():
    # Quick single-position check; tests/unit/test_lossless.py does whole sequences.
    p = np.array([[0.1, 0.6, 0.1, 0.2], [0.25] * 4])
    q = np.array([0.7, 0.0, 0.1, 0.2])      # bad draft: never proposes p's favourite
    rng = np.random.default_rng(5)
    n, counts = 20000, np.zeros(4)
    for _ in range(n):
        x = int(rng.choice(4, p=q))
        k, nxt = verify_stochastic([x], [q], p, rng)
        counts[x if k == 1 else nxt] += 1
    assert np.all(np.abs(counts / n - p[0]) <= 5 * np.sqrt(p[0] * (1 - p[0]) / n))


# ------------------------------------------------------------------ cost model

def test_expected_tokens():
    assert expected_tokens(0.0, 4) == 1.0
    assert expected_tokens(1.0, 4) == 5.0
    assert expected_tokens(0.5, 2) == pytest.approx(1.75)
    assert expected_tokens(0.7, 0) == 1.0
    with pytest.raises(ValueError):
        expected_tokens(1.2, 2)


def test_predicted_speedup_and_choose_gamma():
    flat = lambda k: 1.0                    # memory-bound device: verify ~ one step
    cpu = lambda k: 1.0 + 0.3 * (k - 1)     # 2-core CPU as measured in docs/architecture.md
    assert predicted_speedup(0.8, 0, 0.1, flat) == 1.0
    assert predicted_speedup(0.8, 3, 0.1, flat) == pytest.approx(expected_tokens(0.8, 3) / 1.3)
    g = choose_gamma(0.8, 0.05, flat, 8)
    assert g >= 4
    # an expensive co-located draft on the CPU loses: no speculation
    assert choose_gamma(0.7, 0.4, cpu, 8) == 0
    # a free draft (n-gram, or a remote one) with decent alpha wins on the CPU
    assert choose_gamma(0.7, 0.0, cpu, 8) > 0
    assert choose_gamma(0.0, 0.0, flat, 8) == 0          # useless draft
    assert choose_gamma(0.9, 0.0, flat, 0) == 0
    # margin: demand a clear win
    s1 = predicted_speedup(0.5, 1, 0.0, cpu)
    assert choose_gamma(0.5, 0.0, cpu, 1, margin=0.0) == 1
    assert choose_gamma(0.5, 0.0, cpu, 1, margin=s1) == 0


def test_acceptance_tracker():
    t = AcceptanceTracker(prior=0.5, prior_weight=2.0, decay=1.0)
    assert t.alpha == 0.5
    t.update(4, 4)      # 4 successes
    t.update(4, 1)      # 1 success, 1 failure (tokens 3-4 never tested)
    assert t.alpha == pytest.approx((5 + 1) / (6 + 2))
    t.update(0, 0)      # nothing drafted: no information
    assert t.rounds == 2
    with pytest.raises(ValueError):
        t.update(2, 3)
    # with decay the prior fades: a run of rejections drives alpha to ~0
    t = AcceptanceTracker(prior=0.9, decay=0.9)
    for _ in range(60):
        t.update(1, 0)
    assert t.alpha < 0.01
    # recovers a true geometric alpha
    rng = np.random.default_rng(0)
    t = AcceptanceTracker(decay=0.999)
    for _ in range(3000):
        n = 0
        while n < 4 and rng.random() < 0.8:
            n += 1
        t.update(4, n)
    assert t.alpha == pytest.approx(0.8, abs=0.03)


def test_cost_tracker():
    c = CostTracker(prior_slope=0.3)
    assert c.verify_cost(3) == pytest.approx(1.6) and np.isnan(c.c)
    c.add_target(1, 0.010)
    assert c.verify_cost(3) == pytest.approx(1.6)
    c.add_target(5, 0.022)
    c.add_target(5, 0.900)            # one outlier among three: the median ignores it
    c.add_target(5, 0.022)
    assert c.verify_cost(5) == pytest.approx(2.2)
    assert c.verify_cost(3) == pytest.approx(1.6)         # interpolated
    assert c.verify_cost(9) == pytest.approx(3.4)         # extrapolated with the last slope
    c.add_draft(4, 0.008)
    assert c.c == pytest.approx(0.2)


# ----------------------------------------------------------------------- n-gram

def test_ngram_propose():
    d = NgramDrafter(max_ngram=3, min_ngram=1)
    assert d.propose([1, 2, 3, 4, 1, 2, 3], 2) == [4, 1]
    assert d.propose([1, 2, 3, 4, 1, 2, 3], 10) == [4, 1, 2, 3]   # fewer than gamma
    assert d.propose([5, 6, 7, 9, 6, 7, 8, 6, 7], 3) == [8, 6, 7]  # most recent occurrence
    assert d.propose([1, 2, 3], 3) == []                          # no earlier occurrence
    assert d.propose([7, 7], 3) == [7]
    assert d.propose([9, 1, 2, 8, 0, 2], 2) == [8, 0]              # falls back to n=1
    assert NgramDrafter(2, 2).propose([9, 1, 2, 8, 0, 2], 2) == []
    assert d.propose([1], 3) == [] and d.propose([1, 1], 0) == []
    toks, qs = d.draft([1, 2, 1], 2)
    assert toks == [2, 1] and [q.indices.tolist() for q in qs] == [[2], [1]]
    with pytest.raises(ValueError):
        NgramDrafter(max_ngram=1, min_ngram=2)


# ------------------------------------------------------------------ generation

PROMPT = [3, 1, 4, 1, 5, 9, 2, 6]


@pytest.mark.parametrize("gamma", [1, 2, 3, 4, 5])
def test_speculative_greedy_equals_plain_table(gamma):
    target = TableEngine(seed=1, window=2)
    want = generate_plain(target, PROMPT, 40, GREEDY)
    assert want.n_verify_calls == 40 and want.tokens_per_verify == 1.0
    for draft in (TableEngine(seed=2, window=2), TableEngine(seed=1, window=3)):
        got = generate_speculative(target, ModelDrafter(draft), PROMPT, 40, gamma, GREEDY)
        assert got.tokens == want.tokens
        assert got.n_drafted > 0
    # the target's own table as draft: everything is accepted
    got = generate_speculative(target, ModelDrafter(TableEngine(seed=1, window=2)), PROMPT, 40, gamma, GREEDY)
    assert got.tokens == want.tokens and got.acceptance_rate == 1.0
    assert got.n_verify_calls == -(-40 // (gamma + 1))


@pytest.mark.parametrize("gamma", [1, 3, 5])
def test_speculative_greedy_equals_plain_ngram_and_adaptive(gamma):
    target = TableEngine(seed=4, window=2, vocab=8)
    prompt = [3, 1, 4, 1, 5, 7, 2, 6]
    want = generate_plain(target, prompt, 60, GREEDY)
    got = generate_speculative(target, NgramDrafter(), prompt, 60, gamma, GREEDY)
    assert got.tokens == want.tokens
    assert got.n_accepted > 0 and got.tokens_per_verify > 1.0   # the text loops
    for drafter in (NgramDrafter(), ModelDrafter(TableEngine(seed=5, window=2, vocab=8))):
        got = generate_speculative(target, drafter, prompt, 60, gamma, GREEDY, adaptive=True)
        assert got.tokens == want.tokens
        assert set(got.gammas) <= set(range(gamma + 1))


def test_stop_tokens_max_new_and_callbacks():
    target = TableEngine(seed=1, window=2)
    full = generate_plain(target, PROMPT, 30, GREEDY)
    stop = full.tokens[10]
    first = full.tokens.index(stop)
    seen = []
    for res in (generate_plain(target, PROMPT, 30, GREEDY, stop_ids=[stop], on_token=seen.append),
                generate_speculative(target, ModelDrafter(TableEngine(seed=1, window=3)), PROMPT, 30, 3,
                                     GREEDY, stop_ids=[stop])):
        assert res.tokens == full.tokens[:first]
        assert res.stop_token == stop and res.finish_reason == "stop"
        assert res.n_generated == first + 1
    assert seen == full.tokens[:first]
    for g in (1, 4):
        res = generate_speculative(target, NgramDrafter(), PROMPT, 7, g, GREEDY)
        assert res.tokens == full.tokens[:7] and res.finish_reason == "length"
    assert generate_plain(target, PROMPT, 0, GREEDY).tokens == []


def test_context_limits():
    target = TableEngine(seed=1, window=2, max_len=20)
    with pytest.raises(EngineError, match="context"):
        generate_plain(target, list(range(16)) * 2, 5, GREEDY)
    with pytest.raises(EngineError, match="context"):
        generate_speculative(target, NgramDrafter(), list(range(16)) * 2, 5, 2, GREEDY)
    # generation that runs into the context end stops cleanly, same text both ways
    plain = generate_plain(target, PROMPT, 50, GREEDY)
    spec = generate_speculative(target, ModelDrafter(TableEngine(seed=1, window=2, max_len=15)),
                                PROMPT, 50, 4, GREEDY)
    assert plain.finish_reason == spec.finish_reason == "context"
    assert spec.tokens == plain.tokens and len(plain.tokens) == 20 - len(PROMPT) + 1
    assert target._seqs == {}          # sequences are freed


def test_bad_arguments_raise_clear_errors():
    target = TableEngine(seed=1)
    drafter = ModelDrafter(TableEngine(seed=2))
    for g in (0, -1, 1.5):
        with pytest.raises(ValueError, match="gamma must be"):
            generate_speculative(target, drafter, PROMPT, 5, g, GREEDY)
    with pytest.raises(ValueError, match="vocabularies differ"):
        generate_speculative(target, ModelDrafter(TableEngine(vocab=17)), PROMPT, 5, 2, GREEDY)
    with pytest.raises(ValueError, match="empty"):
        generate_plain(target, [], 5, GREEDY)
    with pytest.raises(ValueError, match="max_new"):
        generate_plain(target, PROMPT, -1, GREEDY)
    with pytest.raises(ValueError, match="top_k"):
        ModelDrafter(target, top_k=-2)


def test_adaptive_switches_speculation_off_when_it_loses():
    ag = AdaptiveGamma(4, warmup=2)
    assert ag.next_gamma() == 0                      # measure plain steps first
    ag.costs.add_target(1, 0.01)
    assert ag.next_gamma() == 0
    ag.costs.add_target(1, 0.01)
    assert ag.next_gamma() == 3                      # then explore once
    ag.costs.add_target(5, 0.05)                     # verify of 5 costs 5 steps (compute-bound)
    ag.costs.add_draft(4, 0.02)                      # c = 0.5
    ag.acceptance.update(4, 1)
    gs = [ag.next_gamma() for _ in range(60)]
    assert gs.count(0) >= 56 and set(gs) <= {0, 1}   # only a few backing-off probes
    # memory-bound verification, a cheap draft, a good alpha: speculate deep
    ag = AdaptiveGamma(4, warmup=1)
    ag.costs.add_target(1, 0.010)
    ag.costs.add_target(5, 0.011)
    ag.costs.add_draft(4, 0.001)
    for _ in range(30):
        ag.acceptance.update(4, 4)
    assert ag.next_gamma() == 4


def test_adaptive_does_not_explore_where_even_a_good_alpha_loses():
    # a draft step at half a target step (these CPUs): even alpha = 0.8 cannot pay -> never draft
    ag = AdaptiveGamma(4, warmup=1)
    ag.costs.add_target(1, 0.010)
    ag.costs.add_draft(1, 0.005)
    assert [ag.next_gamma() for _ in range(100)] == [0] * 100      # no exploration, no probes
    # a draft at a tenth of a step (a memory-bound GPU pair): explore
    ag = AdaptiveGamma(4, warmup=1)
    ag.costs.add_target(1, 0.010)
    ag.costs.add_draft(1, 0.001)
    assert ag.next_gamma() == 3


class FakeClock:
    """perf_counter() for the speculative loop's cost timings: it moves only when a CostedEngine
    computes, so the costs adaptive γ sees are the ones a test gives, not this machine's."""

    def __init__(self) -> None:
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now

    def __getattr__(self, name):
        return getattr(time, name)


class CostedEngine(TableEngine):
    """A table engine each of whose calls costs `step_s` on a FakeClock, whatever its tokens."""

    def __init__(self, clock: FakeClock, step_s: float, **kw):
        super().__init__(**kw)
        self.clock, self.step_s = clock, step_s

    def forward(self, seq, tokens):
        self.clock.now += self.step_s
        return super().forward(seq, tokens)


@pytest.fixture
def fake_clock(monkeypatch):
    import edge.speculative.gamma_rounds as gamma_rounds
    import edge.speculative.generate as generate
    clock = FakeClock()
    for module in (generate, gamma_rounds):     # where the loop and the draft probe read perf_counter
        monkeypatch.setattr(module, "time", clock)
    return clock


def test_adaptive_with_a_costly_draft_is_plain_decoding(fake_clock):
    # a draft step costs 3 target steps (a target call costs one step, whatever its tokens):
    # c = 3 -- no acceptance could pay for it, so adaptive γ prices it once and never drafts
    target = CostedEngine(fake_clock, 0.001, seed=4, window=2)
    drafter = ModelDrafter(CostedEngine(fake_clock, 0.003, seed=4, window=2))   # the same model: it would be right
    got = generate_speculative(target, drafter, PROMPT, 40, 4, GREEDY, adaptive=True)
    assert got.tokens == generate_plain(target, PROMPT, 40, GREEDY).tokens
    assert got.n_drafted == 0 and set(got.gammas) == {0}
    assert [t.kind for t in got.timings].count("draft_probe") == 1       # priced once, never prefilled
    assert not any(t.kind in ("draft", "draft_prefill") for t in got.timings)


def test_stochastic_generation_is_reproducible_with_seed():
    target = TableEngine(seed=1, window=2)
    params = SamplingParams(temperature=0.9, top_p=0.9, seed=123)
    drafter = ModelDrafter(TableEngine(seed=2, window=2), SamplingParams(temperature=1.0), top_k=4)
    a = generate_speculative(target, drafter, PROMPT, 30, 3, params)
    b = generate_speculative(target, drafter, PROMPT, 30, 3, params)
    assert a.tokens == b.tokens and len(a.tokens) == 30
    c = generate_plain(target, PROMPT, 30, params)
    assert c.tokens == generate_plain(target, PROMPT, 30, params).tokens


# ------------------------------------------------- a real transformer, float64

def tiny_torch_engine(arch, seed, noise=0.0, **kw):
    """A tiny random float64 transformer; noise > 0 perturbs it into a draft
    that agrees with the seed's model often but not always."""
    torch = pytest.importorskip("torch")
    from edge.engines.torch_engine import TorchEngine
    from edge.model.transformer import Transformer, tiny_config
    torch.manual_seed(seed)
    model = Transformer(tiny_config(arch, **kw)).double()
    for p in model.parameters():
        p.data.normal_(0, 0.2)
    if noise:
        gen = torch.Generator().manual_seed(seed + 1000)
        for p in model.parameters():
            p.data.add_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * noise)
    return TorchEngine(model, fingerprint=f"tiny-{arch}-{seed}", max_len=64)


@pytest.mark.parametrize("arch, gammas", [("llama", [1, 2, 3, 4, 5]), ("qwen2", [2, 5])])
def test_speculative_greedy_equals_plain_torch_float64(arch, gammas):
    target = tiny_torch_engine(arch, 0)
    draft = tiny_torch_engine(arch, 0, noise=0.02)
    prompt = [5, 17, 99, 3, 42, 7]
    want = generate_plain(target, prompt, 16, GREEDY)
    drafter = ModelDrafter(draft)
    runs = []
    for gamma in gammas:
        runs.append(generate_speculative(target, drafter, prompt, 16, gamma, GREEDY))
        assert runs[-1].tokens == want.tokens, gamma
    # both acceptance and rejection (KV rollback) were exercised
    assert sum(r.n_accepted for r in runs) > 0
    assert any(r.n_accepted < r.n_drafted for r in runs)
    got = generate_speculative(target, NgramDrafter(), prompt, 16, 3, GREEDY)
    assert got.tokens == want.tokens
    # the target as its own draft accepts everything
    got = generate_speculative(target, ModelDrafter(target), prompt, 16, 3, GREEDY)
    assert got.tokens == want.tokens and got.acceptance_rate == 1.0
    drafter.close()
    assert draft.active_sequences == 0


class WildDrafter(Drafter):
    """Random proposals, some outside the vocabulary, and no q at all."""
    vocab_size = None

    def draft(self, context, gamma, rng):
        return [int(x) for x in rng.integers(0, 20, size=gamma)], None


def test_drafter_without_q_and_out_of_vocab_proposals():
    target = TableEngine(seed=1, window=2)          # vocab 16: ids 16..19 are invalid
    want = generate_plain(target, PROMPT, 30, GREEDY)
    assert generate_speculative(target, WildDrafter(), PROMPT, 30, 4, GREEDY).tokens == want.tokens
    res = generate_speculative(target, WildDrafter(), PROMPT, 30, 4, SamplingParams(1.0, seed=3))
    assert len(res.tokens) == 30 and all(0 <= t < 16 for t in res.tokens)


def test_model_drafter_is_reused_across_prompts():
    target = TableEngine(seed=1, window=3)
    draft = TableEngine(seed=1, window=2)
    drafter = ModelDrafter(draft)
    for prompt in (PROMPT, PROMPT[:5] + [7, 7], [2, 2, 2]):
        got = generate_speculative(target, drafter, prompt, 20, 3, GREEDY)
        assert got.tokens == generate_plain(target, prompt, 20, GREEDY).tokens
    assert len(draft._seqs) == 1           # one draft sequence, kept in sync
    drafter.close()
    assert draft._seqs == {}
