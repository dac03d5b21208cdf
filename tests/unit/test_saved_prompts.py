"""A prompt cache's host-memory tier (edge/speculative/saved_prompts.py, PrefixCache ram_bytes): a
conversation evicted from the engine's sequences is saved, restored when it goes on, and the output
equals a cold start's token for token (float64 tiny llamas); bounds, copies and failures."""
import pytest
import torch

from edge.engines.base import EngineError, SavedSequence
from edge.engines.torch_engine import TorchEngine
from edge.speculative.generate import ModelDrafter, generate_plain, generate_speculative
from edge.speculative.prefix_cache import PrefixCache
from edge.speculative.saved_prompts import SavedPrompts
from harness.tiny_models import tiny_model

torch.set_num_threads(1)
SYSTEM = [(7 * i + 3) % 250 + 1 for i in range(40)]
MB = 10 ** 6


@pytest.fixture(scope="module")
def models():
    target = tiny_model(0)
    return target, tiny_model(1, noise=0.02, base=target)


class FixedSlots(TorchEngine):
    """llama.cpp's fixed number of sequences, on a torch engine."""

    def __init__(self, model, limit):
        super().__init__(model, "fixed", threads=1)
        self.limit = self.capacity = limit

    def new_sequence(self):
        if self.active_sequences >= self.limit:
            raise EngineError(f"all {self.limit} sequence slots are in use")
        return super().new_sequence()


def cold(model, prompt, n=12):
    return generate_plain(TorchEngine(model, "cold", threads=1), prompt, n).tokens


def two_conversations(target, cache, model):
    """Conversation A, then B (A is evicted from the one held slot): A's and B's prompts and replies."""
    a = SYSTEM + [11, 12, 13]
    ra = generate_plain(target, a, 10, cache=cache)
    b = [200 + i % 30 for i in range(50)]
    rb = generate_plain(target, b, 10, cache=cache)
    assert ra.tokens == cold(model, a, 10) and rb.tokens == cold(model, b, 10)
    return a + ra.tokens, b + rb.tokens


def test_an_evicted_conversation_is_saved_and_its_next_turn_restores_it(models):
    target = FixedSlots(models[0], 2)
    cache = PrefixCache(target, slots=1, ram_bytes=64 * MB)
    a, _ = two_conversations(target, cache, models[0])
    assert cache.stats["evicted"] == 1 and cache.stats["saved"] == 1 and len(cache.saved) == 1
    turn2 = a + [21, 22]
    r = generate_plain(target, turn2, 12, cache=cache)
    assert cache.stats["restored"] == 1
    assert r.cached_tokens == len(a) - 1                   # the reply's last token was never fed
    assert r.tokens == cold(models[0], turn2)
    assert [t.n_tokens for t in r.timings if t.kind == "prefill"] == [len(turn2) - r.cached_tokens]
    # taken out whole; B, evicted to make room, is the one saved now
    assert len(cache.saved) == 1 and cache.saved.tokens(next(iter(cache.saved._saved)))[:3] == (200, 201, 202)
    assert target.active_sequences == len(cache) == 1


def test_without_the_tier_the_same_turn_is_prefilled_cold(models):
    target = FixedSlots(models[0], 2)
    cache = PrefixCache(target, slots=1)
    assert cache.saved is None
    a, _ = two_conversations(target, cache, models[0])
    r = generate_plain(target, a + [21, 22], 12, cache=cache)
    assert r.cached_tokens == 0 and cache.stats["saved"] == cache.stats["restored"] == 0


def test_a_short_shared_prefix_restores_a_copy_and_keeps_the_saved_conversation(models):
    target = FixedSlots(models[0], 2)
    cache = PrefixCache(target, slots=1, ram_bytes=64 * MB)
    a, _ = two_conversations(target, cache, models[0])
    other = SYSTEM[:20] + [90, 91, 92]                     # 20 of A's 52 tokens: under the reuse rule
    r = generate_plain(target, other, 8, cache=cache)
    assert r.cached_tokens == 20 and r.tokens == cold(models[0], other, 8)
    assert cache.stats["restored"] == 1
    assert any(s.tokens == tuple(a[:len(s.tokens)]) and len(s.tokens) > 40 for s in cache.saved._saved.values())


def test_speculation_over_a_restored_conversation_equals_a_cold_start(models):
    target = FixedSlots(models[0], 2)
    cache = PrefixCache(target, slots=1, ram_bytes=64 * MB)
    a, _ = two_conversations(target, cache, models[0])
    turn2 = a + [31, 32]
    r = generate_speculative(target, ModelDrafter(TorchEngine(models[1], "d", threads=1)), turn2, 16, 3, cache=cache)
    assert cache.stats["restored"] == 1 and r.cached_tokens > 0
    assert r.tokens == cold(models[0], turn2, 16)


def test_the_tier_keeps_within_its_bytes_least_recently_used_first():
    tier = SavedPrompts(100)
    assert not tier.add(SavedSequence((1, 2), None, 101, "w"))         # larger than the whole bound
    for i in range(4):
        assert tier.add(SavedSequence((i + 1, 5), None, 40, "w"))
    assert len(tier) == 2 and tier.bytes == 80 and tier.dropped == 2
    assert tier.best([3, 5, 7], 0)[0] is not None and tier.best([1, 5, 7], 0) == (None, 0)
    assert not tier.add(SavedSequence((), None, 1, "w"))              # nothing to save
    with pytest.raises(ValueError):
        SavedPrompts(-1)


def test_a_byte_bound_smaller_than_a_conversation_saves_nothing(models):
    target = FixedSlots(models[0], 2)
    cache = PrefixCache(target, slots=1, ram_bytes=1000)
    two_conversations(target, cache, models[0])
    assert cache.stats["evicted"] == 1 and cache.stats["saved"] == 0 and len(cache.saved) == 0


class RefusesRestore(FixedSlots):
    def restore_sequence(self, saved):
        raise EngineError("refused")


def test_a_refused_restore_prefills_cold_and_keeps_the_saved_conversation(models):
    target = RefusesRestore(models[0], 2)
    cache = PrefixCache(target, slots=1, ram_bytes=64 * MB)
    a, _ = two_conversations(target, cache, models[0])
    turn2 = a + [21, 22]
    r = generate_plain(target, turn2, 12, cache=cache)
    assert r.tokens == cold(models[0], turn2) and cache.stats["restored"] == 0
    assert any(s.tokens[:len(a) - 1] == tuple(a[:-1]) for s in cache.saved._saved.values())


def test_clear_forgets_the_saved_ones_and_a_saved_sequence_goes_back_only_to_its_weights(models):
    target = FixedSlots(models[0], 2)
    cache = PrefixCache(target, slots=1, ram_bytes=64 * MB)
    two_conversations(target, cache, models[0])
    saved = next(iter(cache.saved._saved.values()))
    with pytest.raises(EngineError, match="only to the model"):
        TorchEngine(models[1], "other", threads=1).restore_sequence(saved)
    cache.clear()
    assert len(cache) == 0 and len(cache.saved) == 0 and target.active_sequences == 0
