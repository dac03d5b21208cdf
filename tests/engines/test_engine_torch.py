"""The torch engine over the KV cache: ragged batching, rollback, KV bytes."""
import numpy as np
import pytest
import torch

from edge.engines.base import EngineError
from edge.engines.torch_engine import TorchEngine
from edge.model.transformer import Transformer, tiny_config


def make_engine(arch="llama", seed=0, **kw):
    torch.manual_seed(seed)
    model = Transformer(tiny_config(arch, **kw)).double()
    for p in model.parameters():
        p.data.normal_(0, 0.2)
    return TorchEngine(model, fingerprint=f"tiny-{arch}-{seed}")


@pytest.fixture(params=["llama", "qwen2"])
def engine(request):
    return make_engine(request.param)


def prompts(n, seed=1):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, size=int(rng.integers(1, 20))).tolist() for _ in range(n)]


def test_forward_in_pieces_equals_one_call(engine):
    toks = prompts(1)[0] + [5, 6, 7, 8]
    a = engine.new_sequence()
    full = engine.forward(a, toks)
    b = engine.new_sequence()
    parts = [engine.forward(b, toks[:3]), engine.forward(b, toks[3:7]), engine.forward(b, toks[7:])]
    np.testing.assert_allclose(np.concatenate(parts), full, rtol=0, atol=1e-12)
    assert engine.length(b) == len(toks)


def test_ragged_step_equals_per_sequence_steps(engine):
    ps = prompts(5)
    batch = [engine.new_sequence() for _ in ps]
    solo = [engine.new_sequence() for _ in ps]
    for s, p in zip(batch + solo, ps + ps):
        engine.forward(s, p)
    rng = np.random.default_rng(7)
    for _ in range(4):
        toks = rng.integers(0, 256, size=len(ps)).tolist()
        got = engine.step(batch, toks)
        want = np.stack([engine.step([s], [t])[0] for s, t in zip(solo, toks)])
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-12)
    assert [engine.length(s) for s in batch] == [len(p) + 4 for p in ps]


def test_step_of_a_subset_in_any_order(engine):
    ps = prompts(4, seed=3)
    seqs = [engine.new_sequence() for _ in ps]
    for s, p in zip(seqs, ps):
        engine.forward(s, p)
    ref = make_engine(engine.cfg.arch)
    r = ref.new_sequence()
    ref.forward(r, ps[2])
    got = engine.step([seqs[2], seqs[0]], [9, 10])
    np.testing.assert_allclose(got[0], ref.forward(r, [9])[0], rtol=0, atol=1e-12)


def test_truncate_then_refeed_equals_fresh_run(engine):
    p = prompts(1, seed=4)[0]
    s = engine.new_sequence()
    engine.forward(s, p + [1, 2, 3, 4])
    engine.truncate(s, len(p) + 1)
    assert engine.tokens(s) == p + [1]
    after = engine.forward(s, [11, 12])
    f = engine.new_sequence()
    fresh = engine.forward(f, p + [1, 11, 12])
    np.testing.assert_allclose(after, fresh[-2:], rtol=0, atol=1e-12)


def test_kv_bytes_round_trip_exactly(engine):
    p = prompts(1, seed=5)[0]
    s = engine.new_sequence()
    engine.forward(s, p)
    blob = engine.export_kv(s, dtype="float64")
    t = engine.import_kv(blob)
    assert engine.length(t) == len(p) and engine.tokens(t) == p
    assert torch.equal(engine._seqs[t].data[..., : len(p), :], engine._seqs[s].data[..., : len(p), :])
    np.testing.assert_array_equal(engine.forward(t, [3]), engine.forward(s, [3]))
    # the fp16 default halves the bytes and stays close
    blob16 = engine.export_kv(s)
    assert len(blob16) < len(blob)


def test_kv_blob_refusals(engine):
    s = engine.new_sequence()
    engine.forward(s, [1, 2, 3])
    blob = engine.export_kv(s)
    other = make_engine(engine.cfg.arch, seed=9)
    with pytest.raises(EngineError, match="made for model"):
        other.import_kv(blob)
    with pytest.raises(EngineError, match="truncated"):
        engine.import_kv(blob[:-7])
    corrupt = bytearray(blob)
    corrupt[-1] ^= 0xFF
    with pytest.raises(EngineError, match="checksum"):
        engine.import_kv(bytes(corrupt))
    with pytest.raises(EngineError, match="magic"):
        engine.import_kv(b"garbage!!!!!")
    wide = make_engine(engine.cfg.arch, num_layers=3)
    wide.fingerprint = engine.fingerprint
    with pytest.raises(EngineError, match="layers"):
        wide.import_kv(blob)


def test_context_overflow_and_bad_ids_are_clear_errors():
    e = make_engine(max_position=16)
    s = e.new_sequence()
    with pytest.raises(EngineError, match="context"):
        e.forward(s, list(range(17)))
    with pytest.raises(EngineError, match="vocabulary"):
        e.forward(s, [999])
    with pytest.raises(EngineError, match="unknown sequence"):
        e.step([12345], [1])
    e.forward(s, list(range(16)))
    with pytest.raises(EngineError, match="context"):
        e.step([s], [1])
