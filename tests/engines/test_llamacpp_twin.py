"""`--repack both` (edge/engines/llamacpp_twin.py) on the real Qwen2.5-Coder-0.5B Q4_K_M: a prefill
of 64+ tokens runs on the unrepacked copy and its KV lands in the repacked model bit for bit as the
unrepacked model computes it, the sequence's cached KV goes there and back unchanged, shorter feeds
stay on the repacked model, a failure leaves the sequence as it was, and it refuses --exact-rows."""
from __future__ import annotations

import numpy as np
import pytest

from harness.agent_asks import qwen_llamacpp
from edge.engines.base import EngineError
from edge.engines.llamacpp_twin import MIN_ROWS

MAX_LEN = 512


@pytest.fixture(scope="module")
def engines():
    plain, tok = qwen_llamacpp(max_len=MAX_LEN, n_seq_max=2)     # skips without the model / llama.cpp
    from edge.engines.llamacpp_engine import LlamaCppEngine
    path = plain.path
    plain.close()
    both = LlamaCppEngine(path, max_len=MAX_LEN, n_seq_max=3, threads=1, extra_bufts=True, mmap=True,
                          prefill_twin=True)
    flat = LlamaCppEngine(path, max_len=MAX_LEN, n_seq_max=2, threads=1, extra_bufts=False)
    yield both, flat, tok
    both.close()
    flat.close()


def kv(engine, seq):
    return engine._parse(engine._get(seq))[0]


def text_ids(tok, n):
    ids = tok.encode("def fibonacci(n):\n    '''Return the n-th Fibonacci number.'''\n" * 40)
    assert len(ids) >= n
    return ids[:n]


def test_a_long_prefill_runs_on_the_twin_and_its_kv_lands_exactly(engines):
    both, flat, tok = engines
    assert both.twin is not None and "unrepacked copy" in both.where()
    ids = text_ids(tok, 150)
    filler = both.new_sequence()                 # the measured sequence sits in slot 1 of 3 streams
    both.forward_last(filler, ids[:5])
    seq, ref = both.new_sequence(), flat.new_sequence()
    before = both.twin.stats["prefills"]
    got = both.forward_last(seq, ids[:100])
    want = flat.forward_last(ref, ids[:100])
    assert both.twin.stats["prefills"] == before + 1
    assert np.array_equal(got, want)                                  # the twin's logits
    assert np.array_equal(kv(both, seq), kv(flat, ref))               # and its KV, moved into slot 1
    assert both.length(seq) == 100 and both.tokens(seq) == ids[:100]
    step = both.step([seq], [ids[100]])                               # the repacked model decodes on it
    assert step.shape == (1, both.vocab_size) and np.isfinite(step).all()
    both.free(filler)
    both.free(seq)
    flat.free(ref)


def test_the_cached_kv_goes_there_and_back_unchanged(engines):
    both, flat, tok = engines
    ids = text_ids(tok, 220)
    seq = both.new_sequence()
    both.forward_last(seq, ids[:20])                 # short: on the repacked model
    for t in ids[20:30]:
        both.step([seq], [t])
    held = kv(both, seq)
    before = both.twin.stats["prefills"]
    both.forward_last(seq, ids[30:30 + MIN_ROWS + 10])
    assert both.twin.stats["prefills"] == before + 1
    after = kv(both, seq)
    assert np.array_equal(after[:, :, :, :30], held)                 # the held cells, bit for bit
    ref = flat.import_kv(both.export_kv(seq, dtype="float16"))       # the unrepacked model from there
    flat.truncate(ref, 30)
    flat.forward_last(ref, ids[30:30 + MIN_ROWS + 10])
    assert np.array_equal(after, kv(flat, ref))
    both.free(seq)
    flat.free(ref)


def test_short_feeds_stay_on_the_repacked_model(engines):
    both, _, tok = engines
    seq = both.new_sequence()
    before = dict(both.twin.stats)
    both.forward_last(seq, text_ids(tok, MIN_ROWS - 1))
    both.forward(seq, text_ids(tok, 5))
    assert both.twin.stats == before and both.length(seq) == MIN_ROWS + 4
    both.free(seq)


def test_a_failed_twin_prefill_leaves_the_sequence_as_it_was(engines, monkeypatch):
    both, _, tok = engines
    ids = text_ids(tok, 200)
    seq = both.new_sequence()
    both.forward_last(seq, ids[:40])
    held = kv(both, seq)

    def broken(*a, **k):
        raise EngineError("llama_decode failed (code 1: no KV slot: context full)")
    monkeypatch.setattr(both.twin.engine, "_feed", broken)
    with pytest.raises(EngineError, match="context full"):
        both.forward_last(seq, ids[40:140])
    monkeypatch.undo()
    assert both.tokens(seq) == ids[:40] and np.array_equal(kv(both, seq), held)
    lc = both._lc
    real = lc.llama_state_seq_set_data
    refusals = []

    def refuse_once(ctx, buf, n, slot):          # llama.cpp clears the sequence, then fails to read it
        if ctx == both._ctx and not refusals:
            refusals.append(slot)
            lc.llama_memory_seq_rm(both._mem, slot, -1, -1)
            return 0
        return real(ctx, buf, n, slot)
    monkeypatch.setattr(lc, "llama_state_seq_set_data", refuse_once)
    with pytest.raises(EngineError, match="refused a sequence's KV"):
        both.forward_last(seq, ids[40:140])
    monkeypatch.undo()
    assert refusals and both.tokens(seq) == ids[:40] and np.array_equal(kv(both, seq), held)
    assert both.forward_last(seq, ids[40:140]).shape == (1, both.vocab_size)   # and it goes on
    assert both.length(seq) == 140
    both.free(seq)


def test_a_context_full_prefill_is_refused_before_the_twin(engines):
    both, _, tok = engines
    seq = both.new_sequence()
    before = dict(both.twin.stats)
    with pytest.raises(EngineError, match="context full"):
        both.forward_last(seq, [tok.encode("x")[0]] * (MAX_LEN + 1))
    assert both.length(seq) == 0 and both.twin.stats == before
    both.free(seq)


def test_exact_rows_and_adapters_turn_it_away(engines):
    both, _, _ = engines
    from edge.engines.llamacpp_engine import LlamaCppEngine
    with pytest.raises(EngineError, match="--repack both cannot go with --exact-rows"):
        LlamaCppEngine(both.path, max_len=64, n_seq_max=1, threads=1, extra_bufts=True, prefill_twin=True,
                       exact_rows=True)
    lone = LlamaCppEngine(both.path, max_len=64, n_seq_max=1, threads=1, extra_bufts=True, mmap=True,
                          prefill_twin=True)
    assert lone.twin is not None
    from edge.engines.llamacpp_lora import LlamaCppAdapters
    LlamaCppAdapters(lone)                       # adapters live on one model: its twin would lack them
    assert lone.twin is None and "unrepacked copy" not in lone.where()
    lone.close()
