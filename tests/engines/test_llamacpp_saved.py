"""A llama.cpp sequence saved to host memory and restored (edge/engines/llamacpp_saved.py), on the real
Qwen2.5-Coder-0.5B: the restored cells are the saved ones bit for bit, in any slot, also through
BatchedCalls and a prompt cache whose one held slot a second conversation took."""
from __future__ import annotations

import numpy as np
import pytest

from harness.agent_asks import qwen_llamacpp
from edge.engines.base import EngineError
from edge.engines.batched_calls import BatchedCalls
from edge.speculative.generate import generate_plain
from edge.speculative.prefix_cache import PrefixCache


@pytest.fixture(scope="module")
def qwen():
    engine, tok = qwen_llamacpp(max_len=1024, n_seq_max=3)
    yield engine, tok
    engine.close()


def ids_of(tok, text):
    return tok.encode(tok.apply_chat_template([{"role": "user", "content": text}]))


def test_a_restored_sequence_gives_the_saved_ones_logits_bit_for_bit_in_another_slot(qwen):
    engine, tok = qwen
    ids = ids_of(tok, "Write a Python function that reverses a string. " * 8)
    a = engine.new_sequence()
    engine.forward_last(a, ids[:-1])
    saved = engine.save_sequence(a)
    assert saved.tokens == tuple(ids[:-1]) and engine.length(a) == len(ids) - 1     # `a` unchanged
    want = engine.forward_last(a, ids[-1:])
    engine.free(a)
    other = engine.new_sequence()                  # slot 0 taken: the copy goes back elsewhere
    b = engine.restore_sequence(saved)
    c = engine.restore_sequence(saved)             # again, into a third slot: the saved copy is unchanged
    try:
        assert engine._slot[b] != 0 and engine.tokens(b) == ids[:-1]
        assert np.array_equal(engine.forward_last(b, ids[-1:]), want)
        assert np.array_equal(engine.forward_last(c, ids[-1:]), want)
    finally:
        engine.free(b)
        engine.free(c)
        engine.free(other)


def test_a_full_engine_refuses_a_restore_and_keeps_nothing(qwen):
    engine, tok = qwen
    a = engine.new_sequence()
    engine.forward_last(a, ids_of(tok, "hello"))
    saved = engine.save_sequence(a)
    held = [a, engine.new_sequence(), engine.new_sequence()]
    try:
        with pytest.raises(EngineError, match="slots are in use"):
            engine.restore_sequence(saved)
        assert engine.active_sequences == 3
    finally:
        for s in held:
            engine.free(s)
    forged = saved.__class__(saved.tokens, saved.data, saved.nbytes, "other weights")
    with pytest.raises(EngineError, match="only to the model"):
        engine.restore_sequence(forged)
    assert engine.active_sequences == 0


def test_a_conversation_evicted_from_the_one_held_slot_comes_back_through_batched_calls(qwen):
    engine, tok = qwen
    shared = BatchedCalls(engine, linger_s=0.01)
    stops = tuple(tok.eos_ids)
    first = ids_of(tok, "Name three sorting algorithms, one line each.")
    warm = PrefixCache(shared, slots=2)                        # the reference: the conversation held
    one = generate_plain(shared, first, 12, stop_ids=stops, cache=warm)
    turn2 = first + one.tokens + tok.encode("\nAnd which is stable?")
    want = generate_plain(shared, turn2, 12, stop_ids=stops, cache=warm)
    warm.clear()
    cache = PrefixCache(shared, slots=1, ram_bytes=64 * 10 ** 6)
    assert generate_plain(shared, first, 12, stop_ids=stops, cache=cache).tokens == one.tokens
    generate_plain(shared, ids_of(tok, "What is a heap?"), 6, stop_ids=stops, cache=cache)   # evicts it
    assert cache.stats["saved"] == 1
    got = generate_plain(shared, turn2, 12, stop_ids=stops, cache=cache)
    assert cache.stats["restored"] == 1 and got.cached_tokens == want.cached_tokens > 0
    assert got.tokens == want.tokens       # the same cells and the same calls: the same text
    cache.clear()
    assert engine.active_sequences == 0
