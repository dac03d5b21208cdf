"""The memory plan counts a target's prompt cache (edge/memory/fit.py; edge/speculative/prefix_cache.py):
on llama.cpp each slot is one more sequence of the whole context, allocated up front; on torch
and onnxruntime what the held tokens allocate, up to the cache's bytes."""
from dataclasses import replace

import pytest

from edge.memory.fit import Workload, cache_slots_that_fit, engine_kwargs, estimate, kv_bytes_per_token
from edge.memory.model_shape import ModelShape

QWEN15 = ModelShape("qwen15", "gguf", layers=28, hidden=1536, intermediate=8960, heads=12, kv_heads=2, head_dim=128,
                    vocab=151936, params=1_777_088_000, stored_bytes=1_111_370_240, quant="Q4_K_M",
                    max_position=32768, tied=False)


def test_llamacpp_counts_each_slot_as_a_whole_sequence():
    bare = estimate(QWEN15, Workload("target", "llamacpp", 4096))
    cached = estimate(QWEN15, Workload("target", "llamacpp", 4096, cache_slots=4, cache_bytes=10**6))
    assert cached.parts["kv"] == 5 * bare.parts["kv"] == 5 * 4096 * 28672    # the byte bound frees nothing
    w = cached.workload
    assert w.engine_sequences == 5 and engine_kwargs("llamacpp", "target", w.engine_sequences) == {"n_seq_max": 5}
    assert cached.to_dict()["prompt_cache"] == 4


@pytest.mark.parametrize("backend", ["torch", "onnx"])
def test_other_backends_count_the_held_tokens_up_to_the_bytes(backend):
    per = kv_bytes_per_token(QWEN15, backend)
    bare = estimate(QWEN15, Workload("target", backend, 2048)).parts["kv"]
    whole = estimate(QWEN15, Workload("target", backend, 2048, cache_slots=2)).parts["kv"]
    assert whole - bare == 2 * 2048 * per                     # two full contexts at most
    capped = estimate(QWEN15, Workload("target", backend, 2048, cache_slots=2, cache_bytes=100 * per)).parts["kv"]
    assert capped - bare == 100 * per


def test_the_most_slots_that_fit():
    w = Workload("target", "llamacpp", 4096, cache_slots=8)
    two = estimate(QWEN15, replace(w, cache_slots=2)).total
    assert cache_slots_that_fit(QWEN15, w, two) == 2
    assert cache_slots_that_fit(QWEN15, w, two - 1) == 1
    assert cache_slots_that_fit(QWEN15, w, 10**6) is None    # not even without a cache


def test_only_a_target_has_a_prompt_cache():
    with pytest.raises(ValueError, match="prompt cache"):
        Workload("draft", "llamacpp", 1024, 4, cache_slots=2)


def test_several_generations_beside_a_cache_get_a_spare_sequence_on_llamacpp():
    """The free slot running sequences are gathered through (edge/engines/stream_placement.py):
    counted in the plan's KV and handed to the engine."""
    one = Workload("target", "llamacpp", 4096, sequences=1, cache_slots=4)
    four = Workload("target", "llamacpp", 4096, sequences=4, cache_slots=4)
    assert one.engine_sequences == 5 and four.engine_sequences == 9
    assert Workload("target", "llamacpp", 4096, sequences=4).engine_sequences == 4      # no cache: nothing scatters
    assert Workload("target", "torch", 4096, sequences=4, cache_slots=4).engine_sequences == 8
    bare = estimate(QWEN15, Workload("target", "llamacpp", 4096)).parts["kv"]
    assert estimate(QWEN15, four).parts["kv"] == 9 * bare
