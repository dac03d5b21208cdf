"""LlamaCppEngine.forward_batch: several sequences' forwards (ragged, forward and forward_last mixed) in one
llama_decode; the rows agree with one call per sequence (batched and single calls are not bit-identical on
llama.cpp: close, same argmax); a call too long for the context leaves every sequence as it was."""
from __future__ import annotations

import numpy as np
import pytest

from edge.engines.base import EngineError
from edge.model.fetch import model_path


@pytest.fixture(scope="module")
def engine():
    pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed: `make llama`")
    path = model_path("smollm2-135m")
    if not path.exists():
        pytest.skip(f"{path} is missing; run `make test-models`")
    from edge.engines.llamacpp_engine import LlamaCppEngine
    eng = LlamaCppEngine(path, max_len=256, n_seq_max=4, threads=1)
    yield eng
    eng.close()


PROMPTS = [[1, 504, 3205, 30, 18, 49], [1, 22, 940, 11, 1380, 7, 23, 4], [1, 77, 88, 99, 1000]]


def test_one_decode_serves_every_call_and_agrees_with_single_calls(engine, monkeypatch):
    singles = []
    for p in PROMPTS:
        s = engine.new_sequence()
        engine.forward_last(s, p[:3])
        singles.append((engine.forward(s, p[3:]), engine.forward_last(s, [5, 6])))
        engine.free(s)
    seqs = [engine.new_sequence() for _ in PROMPTS]
    engine.forward_batch([(s, p[:3], True) for s, p in zip(seqs, PROMPTS)])
    decodes = []
    real = engine._decode
    monkeypatch.setattr(engine, "_decode", lambda e, w: decodes.append(len(e)) or real(e, w))
    out = engine.forward_batch([(s, p[3:]) for s, p in zip(seqs, PROMPTS)])
    last = engine.forward_batch([(s, [5, 6], True) for s in seqs])
    assert decodes == [sum(len(p) - 3 for p in PROMPTS), 2 * len(PROMPTS)]
    for (rows, lrow), got, glast in zip(singles, out, last):
        assert got.shape == rows.shape and glast.shape == (1, engine.vocab_size)
        assert (got.argmax(-1) == rows.argmax(-1)).all() and np.allclose(got, rows, atol=0.5)
        assert glast.argmax() == lrow.argmax()
    assert [engine.tokens(s) for s in seqs] == [p + [5, 6] for p in PROMPTS]
    with pytest.raises(EngineError, match="context full"):
        engine.forward_batch([(seqs[0], [7]), (seqs[1], [7] * engine.max_len)])
    assert [engine.length(s) for s in seqs] == [len(p) + 2 for p in PROMPTS]
    for s in seqs:
        engine.free(s)


def test_forward_tail_computes_the_last_rows_only(engine, monkeypatch):
    """forward_tail: a speculative round feeds forced tokens ahead of its drafts and reads only
    the rows from the last forced one on; llama.cpp is asked for those rows alone."""
    ref, seq = engine.new_sequence(), engine.new_sequence()
    p = PROMPTS[1]
    engine.forward_last(ref, p[:2])
    engine.forward_last(seq, p[:2])
    full = engine.forward(ref, p[2:])
    asked = []
    real = engine._decode
    monkeypatch.setattr(engine, "_decode", lambda e, w: asked.append(list(w)) or real(e, w))
    tail = engine.forward_tail(seq, p[2:], 3)
    assert asked == [[len(p) - 5, len(p) - 4, len(p) - 3]] and tail.shape == (3, engine.vocab_size)
    assert (tail.argmax(-1) == full[-3:].argmax(-1)).all() and np.allclose(tail, full[-3:], atol=0.5)
    assert engine.tokens(seq) == engine.tokens(ref) == p
    batched = engine.forward_batch([(seq, [5, 6, 7], 2), (ref, [5, 6, 7])])
    assert batched[0].shape == (2, engine.vocab_size) and np.allclose(batched[0], batched[1][-2:], atol=0.5)
    with pytest.raises(EngineError, match="at least one row"):
        engine.forward_tail(seq, [1], 0)
    for s in (ref, seq):
        engine.free(s)
