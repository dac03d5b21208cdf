"""edge/speculative/prefix_cache.py: a target's prompt cache is lossless (float64 tiny llamas: every
output equals a cold start's token for token), reuses what it should, and stays in its bounds."""
import pytest
import torch

from edge.engines.base import EngineError
from edge.engines.torch_engine import TorchEngine
from edge.speculative.generate import ModelDrafter, generate_plain, generate_speculative
from edge.speculative.prefix_cache import SHARED_ENOUGH, PrefixCache
from edge.speculative.sampling import SamplingParams
from harness.tiny_models import tiny_model

torch.set_num_threads(1)
SYSTEM = [(7 * i + 3) % 250 + 1 for i in range(40)]        # a "system prompt" every turn starts with


@pytest.fixture(scope="module")
def models():
    target = tiny_model(0)
    return target, tiny_model(1, noise=0.02, base=target)


def engine(model, name="t"):
    return TorchEngine(model, name, threads=1)


def cold(model, prompt, n=12, params=SamplingParams()):
    """The reference: a fresh engine, no cache."""
    return generate_plain(engine(model, "cold"), prompt, n, params).tokens


def test_a_next_turn_reuses_the_conversation_and_equals_a_cold_start(models):
    target = engine(models[0])
    cache = PrefixCache(target, slots=2)
    turn1 = SYSTEM + [11, 12, 13]
    r1 = generate_plain(target, turn1, 12, cache=cache)
    assert r1.cached_tokens == 0 and r1.tokens == cold(models[0], turn1)
    assert len(cache) == 1 and target.active_sequences == 1     # held, not freed
    turn2 = turn1 + r1.tokens + [21, 22]                         # the reply, then the user's next message
    r2 = generate_plain(target, turn2, 12, cache=cache)
    # the KV held the prompt and every reply token but the last (a reply's last token is never fed)
    assert r2.cached_tokens == len(turn1) + len(r1.tokens) - 1
    assert r2.tokens == cold(models[0], turn2)
    assert [t for t in r2.timings if t.kind == "prefill"][0].n_tokens == len(turn2) - r2.cached_tokens
    assert cache.stats["hits"] == 1 and cache.stats["reused_tokens"] == r2.cached_tokens


def test_a_request_identical_to_a_cached_one_feeds_its_last_token(models):
    target = engine(models[0])
    cache = PrefixCache(target)
    prompt = SYSTEM + [5, 6]
    first = generate_plain(target, prompt, 8, cache=cache)
    again = generate_plain(target, prompt, 8, cache=cache)
    assert again.cached_tokens == len(prompt) - 1                # all but the last: its logits are the step's
    assert again.tokens == first.tokens == cold(models[0], prompt, 8)
    # the last token alone is prefilled: its row gives the first token (no second call)
    assert [t.n_tokens for t in again.timings if t.kind == "prefill"] == [1]
    assert again.n_verify_calls == again.n_generated


def test_a_request_that_diverges_early_gets_a_fresh_sequence(models):
    target = engine(models[0])
    cache = PrefixCache(target, slots=4)
    a = SYSTEM + [1, 2, 3]
    generate_plain(target, a, 10, cache=cache)
    early = SYSTEM[:5] + [99] + SYSTEM[6:]                       # 5 shared tokens: too few to take `a`'s KV
    r = generate_plain(target, early, 10, cache=cache)
    assert r.cached_tokens == 0 and r.tokens == cold(models[0], early, 10)
    assert len(cache) == 2                                       # a's conversation survives
    mid = SYSTEM[:30] + [77, 78]                                 # most of what a's sequence holds: reused
    r = generate_plain(target, mid, 10, cache=cache)
    assert r.cached_tokens == 30 and r.tokens == cold(models[0], mid, 10)
    long_shared = [3] * SHARED_ENOUGH + [4] * 200
    generate_plain(target, long_shared, 2, cache=cache)
    r = generate_plain(target, [3] * SHARED_ENOUGH + [9], 4, cache=cache)   # a short share of a long one
    assert r.cached_tokens == SHARED_ENOUGH and r.tokens == cold(models[0], [3] * SHARED_ENOUGH + [9], 4)


def test_the_slot_bound_evicts_the_least_recently_used(models):
    target = engine(models[0])
    cache = PrefixCache(target, slots=2)
    prompts = [[100 + i] * 20 for i in range(3)]
    for p in prompts:
        generate_plain(target, p, 3, cache=cache)
    assert len(cache) == 2 and target.active_sequences == 2 and cache.stats["evicted"] == 1
    assert [h[0] for h in cache.held()] == [101, 102]            # the first conversation went
    r = generate_plain(target, prompts[0], 3, cache=cache)
    assert r.cached_tokens == 0 and r.tokens == cold(models[0], prompts[0], 3)
    generate_plain(target, prompts[2], 3, cache=cache)           # a hit makes it the most recent
    assert [h[0] for h in cache.held()] == [100, 102]


def test_the_byte_bound_holds_what_fits(models):
    target = engine(models[0])
    one = target.seq_kv_bytes(None, 30)                          # what a 30-token conversation allocates
    cache = PrefixCache(target, slots=8, max_bytes=2 * one)
    for i in range(3):
        generate_plain(target, [50 + i] * 20, 5, cache=cache)
    assert len(cache) == 2 and cache.held_bytes <= 2 * one and target.active_sequences == 2
    small = PrefixCache(engine(models[0]), slots=8, max_bytes=one - 1)
    r = generate_plain(small.engine, [7] * 20, 5, cache=small)   # never fits: freed, not held
    assert len(small) == 0 and small.engine.active_sequences == 0
    assert r.tokens == cold(models[0], [7] * 20, 5)


def test_no_cache_slots_frees_as_before(models):
    target = engine(models[0])
    cache = PrefixCache(target, slots=0)
    generate_plain(target, SYSTEM, 4, cache=cache)
    assert len(cache) == 0 and target.active_sequences == 0
    with pytest.raises(ValueError, match="slots"):
        PrefixCache(target, slots=-1)
    with pytest.raises(ValueError, match="another engine"):
        generate_plain(engine(models[0]), SYSTEM, 4, cache=cache)


def test_a_held_sequence_serves_one_request_at_a_time(models):
    target = engine(models[0])
    cache = PrefixCache(target)
    generate_plain(target, SYSTEM, 4, cache=cache)
    s1, k1 = cache.acquire(SYSTEM)
    s2, k2 = cache.acquire(SYSTEM)                               # the held one is out: a fresh one
    assert s1 != s2 and k1 == len(SYSTEM) - 1 and k2 == 0
    cache.release(s1)
    cache.release(s2)                                            # empty: nothing to hold, freed
    assert len(cache) == 1 and target.active_sequences == 1


class FixedSlots(TorchEngine):
    """A torch engine with llama.cpp's fixed number of sequences (advertised as its capacity, or not)."""

    def __init__(self, model, limit, advertised=True):
        super().__init__(model, "fixed", threads=1)
        self.limit = limit
        self.capacity = limit if advertised else None

    def new_sequence(self):
        if self.active_sequences >= self.limit:
            raise EngineError(f"all {self.limit} sequence slots are in use")
        return super().new_sequence()


@pytest.mark.parametrize("advertised", [True, False])
def test_a_request_always_gets_a_sequence_on_a_fixed_number_of_slots(models, advertised):
    target = FixedSlots(models[0], 2, advertised)
    cache = PrefixCache(target, slots=4)                         # more slots than the engine has
    for i in range(4):
        p = [60 + i] * 12
        assert generate_plain(target, p, 3, cache=cache).tokens == cold(models[0], p, 3)
        assert target.active_sequences == len(cache) <= 2
    assert cache.stats["evicted"] >= 2


def test_through_speculation_with_a_local_draft(models):
    target, draft = engine(models[0]), engine(models[1], "d")
    cache = PrefixCache(target)
    drafter = ModelDrafter(draft)
    turn1 = SYSTEM + [8, 9]
    r1 = generate_speculative(target, drafter, turn1, 16, 3, cache=cache)
    assert r1.tokens == cold(models[0], turn1, 16) and r1.n_accepted > 0
    turn2 = turn1 + r1.tokens + [30, 31, 32]
    r2 = generate_speculative(target, drafter, turn2, 16, 3, cache=cache)
    assert r2.cached_tokens >= len(turn1) + len(r1.tokens) - 1
    assert r2.tokens == cold(models[0], turn2, 16)
    r3 = generate_speculative(target, drafter, turn2, 16, 4, adaptive=True, cache=cache)
    assert r3.cached_tokens == len(turn2) - 1 and r3.tokens == r2.tokens


def test_a_seeded_sampled_request_replays_identically_with_the_cache(models):
    target = engine(models[0])
    cache = PrefixCache(target)
    params = SamplingParams(temperature=0.9, top_p=0.95, seed=1234)
    turn1 = SYSTEM + [2]
    r1 = generate_plain(target, turn1, 10, params, cache=cache)
    assert r1.tokens == cold(models[0], turn1, 10, params)
    turn2 = turn1 + r1.tokens + [3, 4]
    r2 = generate_plain(target, turn2, 10, params, cache=cache)
    assert r2.cached_tokens > len(turn1) and r2.tokens == cold(models[0], turn2, 10, params)
    spec = generate_speculative(target, ModelDrafter(engine(models[1], "d"), params), turn2, 10, 3, params,
                                cache=cache)
    want = generate_speculative(engine(models[0], "c"), ModelDrafter(engine(models[1], "d2"), params), turn2, 10, 3,
                                params)
    assert spec.cached_tokens == len(turn2) - 1 and spec.tokens == want.tokens


class Stop(Exception):
    pass


def test_a_generation_stopped_by_its_caller_is_kept_and_reports_what_it_reused(models):
    target = engine(models[0])
    cache = PrefixCache(target)
    generate_plain(target, SYSTEM, 4, cache=cache)
    seen = []

    def on_token(t):
        seen.append(t)
        if len(seen) == 3:
            raise Stop()
    with pytest.raises(Stop) as e:
        generate_plain(target, SYSTEM + [1, 2], 10, on_token=on_token, cache=cache)
    assert e.value.gen_result.cached_tokens == len(SYSTEM) and e.value.gen_result.tokens == seen
    assert len(cache) == 1 and target.active_sequences == 1      # kept: its KV matches its tokens
    r = generate_plain(target, SYSTEM + [1, 2] + seen + [5], 6, cache=cache)
    assert r.cached_tokens >= len(SYSTEM) + 2 + 2 and r.tokens == cold(models[0], SYSTEM + [1, 2] + seen + [5], 6)

    def interrupt(t):
        raise KeyboardInterrupt
    with pytest.raises(KeyboardInterrupt):
        generate_plain(target, SYSTEM, 4, on_token=interrupt, cache=cache)
    assert len(cache) == 0 and target.active_sequences == 0      # not trusted: freed
    cache.clear()


class _Refeeding(TorchEngine):
    """An engine whose short prefills pay to feed `back` held tokens again (as llama.cpp's tiles)."""
    back = 5

    def prefill_refeed(self, held: int, new: int) -> int:
        return min(held, self.back) if new > 1 else 0


def test_held_tokens_fed_again_for_speed_leave_the_output_a_cold_starts(models):
    target = _Refeeding(models[0], "t", threads=1)
    draft = engine(models[1], "d")
    cache = PrefixCache(target, slots=2)
    turn1 = SYSTEM + [11, 12, 13]
    r1 = generate_plain(target, turn1, 12, cache=cache)
    turn2 = turn1 + r1.tokens + [21, 22]
    r2 = generate_speculative(target, ModelDrafter(draft), turn2, 12, 3, cache=cache)
    held = len(turn1) + len(r1.tokens) - 1                       # what the KV held of turn2
    assert r2.cached_tokens == held - _Refeeding.back            # fed again: not counted as reused
    assert [t.n_tokens for t in r2.timings if t.kind == "prefill"] == [len(turn2) - r2.cached_tokens]
    assert r2.tokens == cold(models[0], turn2)
    assert cache.stats["reused_tokens"] == r2.cached_tokens
