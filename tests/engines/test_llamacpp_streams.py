"""A llama.cpp batch over scattered KV streams: the engine moves the sequences onto one run of
consecutive slots (one ubatch, edge/engines/stream_placement.py) and the logits, now and after
more steps, are the ones the same batch gives on slots that were consecutive from the start."""
from __future__ import annotations

import numpy as np
import pytest

from edge.model.fetch import model_path


@pytest.fixture(scope="module")
def smol():
    pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed: `make llama`")
    path = model_path("smollm2-135m")
    if not path.exists():
        pytest.skip(f"{path} is missing; run `make test-models`")
    return path


def _engine(path, slots):
    from edge.engines.llamacpp_engine import LlamaCppEngine
    return LlamaCppEngine(path, max_len=256, n_seq_max=slots, threads=1)


PROMPTS = [[1, 504, 3205, 30, 18, 49], [1, 22, 940, 11, 1380, 7, 23, 4], [1, 77, 88, 99, 1000]]


def _run(engine, seqs, steps=4):
    """Prefill every prompt, then step the batch greedily; the rows of every step."""
    for s, p in zip(seqs, PROMPTS):
        engine.forward_last(s, p[:-1])
    toks, out = [p[-1] for p in PROMPTS], []
    for _ in range(steps):
        rows = engine.step(seqs, toks)
        out.append(rows)
        toks = [int(np.argmax(r)) for r in rows]
    return out


def test_scattered_batch_is_gathered_onto_one_run_with_the_same_logits(smol):
    ref_eng = _engine(smol, 3)
    ref = _run(ref_eng, [ref_eng.new_sequence() for _ in PROMPTS])
    ref_eng.close()

    eng = _engine(smol, 8)
    seqs = [eng.new_sequence() for _ in range(7)]
    for s in seqs[1::2] + seqs[:1]:          # slots 0, 1, 3, 5 freed: the batch sits on 2, 4, 6
        eng.free(s)
    batch = [seqs[6], seqs[2], seqs[4]]      # and out of slot order
    assert sorted(eng._slot[s] for s in batch) == [2, 4, 6]
    got = _run(eng, batch)
    slots = sorted(eng._slot[s] for s in batch)
    assert slots == list(range(slots[0], slots[0] + 3)), slots
    assert eng.moves == 1                   # slot 6 into the free slot 3: {2, 3, 4}
    for step, (a, b) in enumerate(zip(got, ref)):
        assert np.array_equal(a.argmax(-1), b.argmax(-1)), f"step {step}"
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-3)
    eng.close()


def test_a_new_sequence_takes_the_lowest_free_slot(smol):
    eng = _engine(smol, 4)
    a, b, c = (eng.new_sequence() for _ in range(3))
    eng.free(a)
    eng.free(b)
    assert eng._slot[eng.new_sequence()] == 0
    assert eng._slot[eng.new_sequence()] == 1
    eng.close()


def test_a_move_queued_by_a_failed_decode_is_applied_before_a_kv_import_reuses_its_source(smol):
    """A batch that fails llama.cpp's own checks right after a stream move leaves the copy queued
    (it runs at the next decode); importing a KV into the move's source slot must not let that
    copy carry the imported cache over the moved sequence."""
    from edge.engines.base import EngineError
    ref_eng = _engine(smol, 1)
    r = ref_eng.new_sequence()
    ref_eng.forward_last(r, PROMPTS[2][:-1])
    ref = ref_eng.step([r], [PROMPTS[2][-1]])
    ref_eng.close()

    eng = _engine(smol, 4)
    a, b, c = (eng.new_sequence() for _ in range(3))     # slots 0, 1, 2
    eng.forward_last(a, PROMPTS[0][:-1])
    eng.forward_last(c, PROMPTS[2][:-1])
    blob = eng.export_kv(a)                               # (the state layout is known from here on)
    eng.free(b)                                           # slot 1 free: the batch [a, c] moves c 2 -> 1
    eng._tokens[a].append(PROMPTS[0][-1])                 # a position gap: llama.cpp refuses the batch
    with pytest.raises(EngineError):
        eng.step([a, c], [PROMPTS[0][-1], PROMPTS[2][-1]])
    eng._tokens[a].pop()
    assert eng._slot[c] == 1 and eng.moves == 1
    d = eng.import_kv(blob)                               # into slot 2, the queued copy's source
    assert eng._slot[d] == 2
    got = eng.step([c], [PROMPTS[2][-1]])
    np.testing.assert_allclose(got, ref, rtol=0, atol=1e-3)
    eng.close()
