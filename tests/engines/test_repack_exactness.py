"""The llama.cpp engine's default keeps a verify of k rows equal to k one-row calls on the real
Qwen2.5-Coder-0.5B Q4_K_M, so greedy speculative text stays the target's plain text bit for bit:
ggml-cpu's repacked Q4_K weights round a multi-row call differently (the negative control, with
repacking on as `--repack on` asks through the placement: llama.cpp then reports a CPU_REPACK
weight buffer), so the engine turns repacking off for such files (llamacpp_repack.py). A Q4_1
file (SmolLM2-135M) keeps repacking: its rows are equal with it. On a build with the AMX backend
`on` is refused (off, rows exact, a warning), not crashed on."""
import numpy as np
import pytest

from harness.agent_asks import fetched_or_skip

pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed: `make llama`")
from edge.engines.llamacpp_engine import LlamaCppEngine  # noqa: E402
from edge.engines.llamacpp_load import repack_keeps_rows_exact  # noqa: E402
from edge.engines.placement import Capabilities, decide_placement  # noqa: E402

CPU = Capabilities(llama_gpu_offload=False)


def _rows_vs_one_by_one(path, **kw) -> float:
    """Max |logit difference| between one call over 5 tokens and 5 one-token calls, after 300."""
    return _diff_and_choice(path, **kw)[0]


def _diff_and_choice(path, **kw):
    """(_rows_vs_one_by_one's difference, the engine's RepackChoice, what llama.cpp was told)."""
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
        return float(np.abs(rows - one_by_one).max()), engine.repack, bool(engine.model_params.use_extra_bufts)
    finally:
        engine.close()


def test_q4_k_m_rows_are_exact_by_default_and_not_when_repacked(capsys):
    q4_k_m, = fetched_or_skip("qwen2.5-coder-0.5b")
    assert not repack_keeps_rows_exact(str(q4_k_m))
    diff, choice, told = _diff_and_choice(q4_k_m, verbose=True)          # auto
    report = capsys.readouterr().err                                     # llama.cpp's own load log
    assert diff == 0.0 and (choice.extra_bufts, told) == (False, False)
    assert "CPU_Mapped model buffer size" in report and "CPU_REPACK" not in report
    on = decide_placement("llamacpp", "cpu", None, None, CPU, repack="on").engine_kwargs()
    diff, choice, told = _diff_and_choice(q4_k_m, verbose=True, **on)
    report = capsys.readouterr().err
    assert diff > 0.0                                                    # the check can fail
    assert (choice.extra_bufts, told) == (True, True) and "near-ties" in choice.why
    assert "CPU_REPACK model buffer size" in report                     # llama.cpp repacked weights


def test_the_amx_guard_wins_over_repack_on(monkeypatch, caplog):
    """A build with ggml's AMX backend crashes on repacked weights: `on` is refused, said, and the
    rows stay exact (this build has no AMX backend: its probe is replaced)."""
    from edge.engines import llamacpp_load
    q4_k_m, = fetched_or_skip("qwen2.5-coder-0.5b")
    monkeypatch.setattr(llamacpp_load, "amx_compiled", lambda lc: True)
    with caplog.at_level("WARNING", logger="edge.engines.llamacpp_load"):
        diff, choice, told = _diff_and_choice(q4_k_m, extra_bufts=True)
    assert diff == 0.0 and (choice.extra_bufts, choice.amx_guard, told) == (False, True, False)
    assert ("weight repacking off (on was asked, refused: this llama.cpp was built with ggml's AMX backend"
            in caplog.text)


def test_q4_1_keeps_repacking_and_exact_rows():
    q4_1, = fetched_or_skip("smollm2-135m")
    assert repack_keeps_rows_exact(str(q4_1))
    assert _rows_vs_one_by_one(q4_1) == 0.0
