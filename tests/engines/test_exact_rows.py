"""Exact rows (edge/engines/llamacpp_rows.py) on the real Qwen2.5-Coder-0.5B Q4_K_M: with them a
row's logits are the same bit for bit whatever call computes it -- a verify of 5 rows, 5 one-row
decodes, a step over two sequences, a ragged batch -- repacked or not, at one thread and two, so
greedy speculative text is the target's plain text. Without them llama.cpp rounds rows by the
call's shape (the negative control: two threads over 300 cached tokens split a one-row decode's
attention between the threads). `--repack auto` leaves this file unrepacked and repacks a Q4_1
one (SmolLM2-135M); on a build with the AMX backend `on` is refused (off, a warning), not crashed on."""
import numpy as np
import pytest

from harness.agent_asks import fetched_or_skip

pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed: `make llama`")
from edge.engines.llamacpp_engine import LlamaCppEngine  # noqa: E402
from edge.engines.llamacpp_load import auto_repacks  # noqa: E402
from edge.engines.placement import Capabilities, decide_placement  # noqa: E402

CPU = Capabilities(llama_gpu_offload=False)


def _shapes(path, threads, **kw):
    """The logits of 5 tokens after 300, computed four ways: (one 5-row forward, 5 one-row calls,
    5 steps over two sequences, a batch beside another sequence's 2 tokens), and the engine."""
    engine = LlamaCppEngine(str(path), max_len=512, n_seq_max=5, threads=threads, **kw)
    rng = np.random.default_rng(1)
    prefix = [int(x) for x in rng.integers(100, 20000, size=300)]
    new = [int(x) for x in rng.integers(100, 20000, size=5)]
    a, b, c, d = (engine.new_sequence() for _ in range(4))
    for s in (a, b, c, d):
        engine.forward_last(s, prefix)
    rows = engine.forward(a, new)
    one_by_one = np.concatenate([engine.forward_last(b, [t]) for t in new])
    steps = np.stack([engine.step([c, d], [t, t])[0] for t in new])
    d2 = engine.new_sequence()
    engine.forward_last(d2, prefix)
    batched = engine.forward_batch([(d2, new, 0), (d, new[:2], 0)])[0]
    return (rows, one_by_one, steps, batched), engine


@pytest.mark.parametrize("threads,repack", [(1, False), (2, False), (2, True)])
def test_exact_rows_are_equal_whatever_the_call(threads, repack):
    q4_k_m, = fetched_or_skip("qwen2.5-coder-0.5b")
    (rows, *others), engine = _shapes(q4_k_m, threads, exact_rows=True, extra_bufts=repack)
    try:
        assert engine.exact_rows and engine.repack.on == repack
        assert engine.max_len == 512 - 8                  # the last cells are kept for the padding
        for other in others:
            assert np.array_equal(rows, other)
        for seq in engine._tokens:                         # no padding's cell left behind
            pos_max = engine._lc.llama_memory_seq_pos_max(engine._mem, engine._get(seq))
            assert pos_max == engine.length(seq) - 1
    finally:
        engine.close()


def test_without_exact_rows_two_threads_round_a_lone_row_differently():
    """The negative control: llama.cpp alone, two threads, 300 tokens cached (512 cells): a one-row
    decode splits its attention between the threads, a 5-row verify does not."""
    q4_k_m, = fetched_or_skip("qwen2.5-coder-0.5b")
    (rows, one_by_one, *_), engine = _shapes(q4_k_m, 2)
    engine.close()
    assert np.abs(rows - one_by_one).max() > 0.0


def test_auto_leaves_k_quants_unrepacked_and_repacks_q4_1(capsys):
    q4_k_m, = fetched_or_skip("qwen2.5-coder-0.5b")
    assert not auto_repacks(str(q4_k_m))
    engine = LlamaCppEngine(str(q4_k_m), max_len=256, n_seq_max=1, threads=1, verbose=True)
    engine.close()
    report = capsys.readouterr().err                                     # llama.cpp's own load log
    assert engine.repack.extra_bufts is False and "CPU_REPACK" not in report
    on = decide_placement("llamacpp", "cpu", None, None, CPU, repack="on").engine_kwargs()
    engine = LlamaCppEngine(str(q4_k_m), max_len=256, n_seq_max=1, threads=1, verbose=True, **on)
    engine.close()
    assert engine.model_params.use_extra_bufts and "CPU_REPACK model buffer size" in capsys.readouterr().err
    q4_1, = fetched_or_skip("smollm2-135m")
    assert auto_repacks(str(q4_1))


def test_the_amx_guard_wins_over_repack_on(monkeypatch, caplog):
    """A build with ggml's AMX backend crashes on repacked weights: `on` is refused and said (this
    build has no AMX backend: its probe is replaced)."""
    from edge.engines import llamacpp_load
    q4_k_m, = fetched_or_skip("qwen2.5-coder-0.5b")
    monkeypatch.setattr(llamacpp_load, "amx_compiled", lambda lc: True)
    with caplog.at_level("WARNING", logger="edge.engines.llamacpp_load"):
        engine = LlamaCppEngine(str(q4_k_m), max_len=256, n_seq_max=1, threads=1, extra_bufts=True)
    engine.close()
    assert (engine.repack.extra_bufts, engine.repack.amx_guard) == (False, True)
    assert not engine.model_params.use_extra_bufts
    assert ("weight repacking off (on was asked, refused: this llama.cpp was built with ggml's AMX backend"
            in caplog.text)
