"""The memory planner (edge/memory/fit.py): estimates of known shapes, fits or not, the most that fits.

The constants themselves are checked against measured peak RSS by benchmarks/device/memory_plan.py
(benchmarks/results/memory_plan/default.md); these tests pin the arithmetic the estimate is made of.
"""
import inspect
from dataclasses import replace

import pytest

from edge.memory.fit import (LLAMACPP_CTX_PAD, LLAMACPP_SEQUENCES, Workload, engine_kwargs, estimate, fit,
                              kv_bytes_per_token, parse_bytes, role_sequences)
from edge.memory.model_shape import ModelShape

# Qwen2.5-Coder-1.5B-Instruct Q4_K_M as its GGUF header gives it (untied: the file has output.weight)
QWEN15 = ModelShape("qwen15", "gguf", layers=28, hidden=1536, intermediate=8960, heads=12, kv_heads=2, head_dim=128,
                    vocab=151936, params=1_777_088_000, stored_bytes=1_111_370_240, quant="Q4_K_M",
                    max_position=32768, tied=False)
SMOL = ModelShape("smol", "gguf", layers=30, hidden=576, intermediate=1536, heads=9, kv_heads=3, head_dim=64,
                  vocab=49152, params=134_515_008, stored_bytes=96_576_768, quant="Q4_1", max_position=8192)


def test_kv_bytes_per_token_by_backend():
    assert kv_bytes_per_token(QWEN15, "llamacpp") == 28 * 2 * 2 * 128 * 2 == 28672      # f16 cache
    assert kv_bytes_per_token(QWEN15, "onnx") == 57344                                  # fp32 numpy
    assert kv_bytes_per_token(QWEN15, "torch", "bfloat16") == 28672
    assert kv_bytes_per_token(SMOL, "torch") == 30 * 2 * 3 * 64 * 4


def test_llamacpp_kv_is_context_times_sequences_up_front():
    one = estimate(QWEN15, Workload("target", "llamacpp", 4096, 1))
    assert one.parts["kv"] == 4096 * 28672 and one.parts["weights"] == QWEN15.stored_bytes
    eight = estimate(QWEN15, Workload("draft", "llamacpp", 4096, 8))
    assert eight.parts["kv"] == 8 * one.parts["kv"]
    padded = estimate(QWEN15, Workload("target", "llamacpp", 1000, 1))   # rounded up to whole 256-cell blocks
    assert padded.kv_tokens == 1024 == -(-1000 // LLAMACPP_CTX_PAD) * LLAMACPP_CTX_PAD


def test_torch_weights_follow_the_dtype_and_tied_embeddings():
    fp32 = estimate(SMOL, Workload("target", "torch", 1024))
    assert fp32.parts["weights"] == SMOL.params * 4                     # tied: the whole matrix is read
    bf16 = estimate(SMOL, Workload("target", "torch", 1024, dtype="bfloat16"))
    assert bf16.parts["weights"] == SMOL.params * 2
    assert bf16.parts.get("loading", 0) > 0                             # fp32 file pages while converting
    untied = estimate(QWEN15, Workload("target", "torch", 512))         # only the rows of tokens seen
    assert untied.parts["weights"] == (QWEN15.params - (QWEN15.vocab - 512) * QWEN15.hidden) * 4
    # torch grows a sequence's cache by doubling up to the context: at 3000 it holds 3000 slots, and
    # the 2048 it grew from while copying
    assert estimate(SMOL, Workload("target", "torch", 3000)).kv_tokens == 3000 + 2048
    assert estimate(SMOL, Workload("target", "torch", 4096)).kv_tokens == 4096 + 2048


def test_onnx_counts_every_positions_logits_unless_it_is_a_prefill_graph():
    model = estimate(SMOL, Workload("target", "onnx", 1024))
    prefill = estimate(replace(SMOL, graph="prefill"), Workload("target", "onnx", 1024))
    assert model.parts["compute"] - prefill.parts["compute"] == 2 * (1024 - 5) * SMOL.vocab * 4


def test_fits_and_does_not_fit_at_the_boundary():
    w = Workload("target", "llamacpp", 4096)
    total = estimate(QWEN15, w).total
    assert fit(QWEN15, w, total).fits and fit(QWEN15, w, total).headroom == 0
    short = fit(QWEN15, w, total - 1)
    assert not short.fits and short.headroom == -1


@pytest.mark.parametrize("role,backend,shape", [("target", "llamacpp", QWEN15), ("draft", "llamacpp", QWEN15),
                                                 ("draft", "torch", SMOL), ("decoder", "onnx", SMOL)])
def test_largest_context_and_sequences_are_the_largest_that_fit(role, backend, shape):
    w = Workload(role, backend, 2048, 4 if role != "target" else 1)
    budget = int(estimate(shape, w).total * 1.3)
    f = fit(shape, w, budget)
    assert 0 < f.max_context < shape.max_position
    assert estimate(shape, replace(w, context=f.max_context)).total <= budget
    assert estimate(shape, replace(w, context=f.max_context + 1)).total > budget
    assert estimate(shape, replace(w, sequences=f.max_sequences)).total <= budget
    assert estimate(shape, replace(w, sequences=f.max_sequences + 1)).total > budget
    assert f.kv_budget_bytes == budget - (f.estimate.total - f.estimate.parts["kv"])


def test_nothing_fits_a_budget_below_the_weights():
    f = fit(QWEN15, Workload("target", "llamacpp", 4096), QWEN15.stored_bytes // 2)
    assert not f.fits and f.max_context == 0


def test_parse_bytes():
    assert parse_bytes("5.5G") == 5_500_000_000 and parse_bytes("800M") == 800_000_000
    assert parse_bytes("6GiB") == 6 * 2 ** 30 and parse_bytes("1024") == 1024
    with pytest.raises(ValueError, match="not a size"):
        parse_bytes("lots")


def test_what_run_builds():
    from edge.engines.llamacpp_engine import LlamaCppEngine
    assert inspect.signature(LlamaCppEngine).parameters["n_seq_max"].default == LLAMACPP_SEQUENCES
    assert engine_kwargs("llamacpp", "target", role_sequences("target", "llamacpp")) == {"n_seq_max": 1}
    assert role_sequences("draft", "llamacpp", max_sessions=3) == 3
    assert role_sequences("draft", "llamacpp", max_sessions=64) == LLAMACPP_SEQUENCES
    assert role_sequences("decoder", "onnx", max_batch=16) == 16
    assert engine_kwargs("onnx", "target", 1) == {} and engine_kwargs("torch", "draft", 64) == {}
