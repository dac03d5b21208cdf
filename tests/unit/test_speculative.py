"""edge/speculative/generate.py: speculative == plain greedy output (table, n-gram, adaptive γ, torch
float64), stops, limits and bad arguments. The verification math and prompt lookup alone:
tests/unit/test_verify_math.py."""
import time

import pytest

from edge.engines.base import EngineError
from edge.speculative.drafter import Drafter
from edge.speculative.local_gamma import AdaptiveGamma
from edge.speculative.generate import ModelDrafter, generate_plain, generate_speculative
from edge.speculative.ngram import NgramDrafter
from edge.speculative.sampling import SamplingParams
from harness.table_engine import TableEngine

GREEDY = SamplingParams()


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
    # the prefill's row gives the first token (a call that yielded one), then rounds of gamma + 1
    assert got.n_verify_calls == 1 + -(-39 // (gamma + 1))


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
    import edge.speculative.model_drafter as model_drafter
    clock = FakeClock()
    for module in (generate, gamma_rounds, model_drafter):   # where the loop and the draft probe read perf_counter
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
