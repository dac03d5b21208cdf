"""The llama.cpp engine's default keeps a verify of k rows equal to k one-row calls on the real
Qwen2.5-Coder-0.5B Q4_K_M, so greedy speculative text stays the target's plain text bit for bit:
ggml-cpu's repacked Q4_K weights round a multi-row call differently (the negative control, with
repacking forced on), so the engine turns repacking off for such files (llamacpp_load.py). A Q4_1
file (SmolLM2-135M) keeps repacking: its rows are equal with it."""
import numpy as np
import pytest

from harness.agent_asks import fetched_or_skip

pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed: `make llama`")
from edge.engines.llamacpp_engine import LlamaCppEngine  # noqa: E402
from edge.engines.llamacpp_load import repack_keeps_rows_exact  # noqa: E402


def _rows_vs_one_by_one(path, **kw) -> float:
    """Max |logit difference| between one call over 5 tokens and 5 one-token calls, after 300."""
    engine = LlamaCppEngine(str(path), max_len=512, n_seq_max=2, threads=1, **kw)
    try:
        rng = np.random.default_rng(1)
        prefix = [int(x) for x in rng.integers(100, 20000, size=300)]
        new = [int(x) for x in rng.integers(100, 20000, size=5)]
        a, b = engine.new_sequence(), engine.new_sequence()
        engine.forward_last(a, prefix)
        engine.forward_last(b, prefix)
        rows = engine.forward(a, new)
        one_by_one = np.concatenate([engine.forward_last(b, [t]) for t in new])
        return float(np.abs(rows - one_by_one).max())
    finally:
        engine.close()


def test_q4_k_m_rows_are_exact_by_default_and_not_when_repacked():
    q4_k_m, = fetched_or_skip("qwen2.5-coder-0.5b")
    assert not repack_keeps_rows_exact(str(q4_k_m))
    assert _rows_vs_one_by_one(q4_k_m) == 0.0
    assert _rows_vs_one_by_one(q4_k_m, extra_bufts=True) > 0.0      # the check can fail


def test_q4_1_keeps_repacking_and_exact_rows():
    q4_1, = fetched_or_skip("smollm2-135m")
    assert repack_keeps_rows_exact(str(q4_1))
    assert _rows_vs_one_by_one(q4_1) == 0.0
