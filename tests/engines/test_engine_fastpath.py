"""The torch engine's fast path (in-place KV, per-sequence attention, skinny matmuls) equals
the functional reference path (`fast=False`: Transformer.forward + padded gather).

float64 tiny models, so any difference is a bug and not rounding (atol 1e-10).
"""
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from edge.engines.torch_engine import TorchEngine, default_threads
from edge.model.kv import BatchCache, SequenceKV
from edge.model.transformer import Transformer, fast_linear, tiny_config

ATOL = 1e-10
CONFIGS = {
    "llama-gqa": dict(arch="llama"),                        # 4 query heads on 2 kv heads
    "qwen2-bias": dict(arch="qwen2"),                       # q/k/v bias, untied lm_head
    "llama-mha": dict(arch="llama", num_kv_heads=4),        # no grouping
    "qwen2-gqa4": dict(arch="qwen2", num_heads=8, num_kv_heads=2, hidden_size=64),
}


def make_model(name, seed=0, **kw):
    torch.manual_seed(seed)
    cfg = dict(CONFIGS[name])
    cfg.update(kw)
    model = Transformer(tiny_config(**cfg)).double()
    for p in model.parameters():
        p.data.normal_(0, 0.2)
    return model


@pytest.fixture(params=list(CONFIGS))
def pair(request):
    """(reference engine, fast engine) over the same weights."""
    model = make_model(request.param)   # one thread: the skinny kernel runs only there
    return (TorchEngine(model, fingerprint="tiny", fast=False, threads=1),
            TorchEngine(model, fingerprint="tiny", fast=True, threads=1))


def prompts(n, seed=1, lo=1, hi=24):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, size=int(rng.integers(lo, hi))).tolist() for _ in range(n)]


def close(a, b):
    np.testing.assert_allclose(a, b, rtol=0, atol=ATOL)


def test_prefill_and_verify_calls_match(pair):
    ref, fast = pair
    p = prompts(1)[0]
    r, f = ref.new_sequence(), fast.new_sequence()
    close(fast.forward(f, p), ref.forward(r, p))
    rng = np.random.default_rng(2)
    for k in range(1, 10):              # 1..5 rows: skinny kernel; 6..9: F.linear
        toks = rng.integers(0, 256, k).tolist()
        close(fast.forward(f, toks), ref.forward(r, toks))
    assert fast.length(f) == ref.length(r) == len(p) + 45
    assert fast.tokens(f) == ref.tokens(r)


def test_forward_last_is_the_last_row(pair):
    ref, fast = pair
    p = prompts(1, seed=3)[0] + [1, 2]
    full = ref.forward(ref.new_sequence(), p)
    f = fast.new_sequence()
    last = fast.forward_last(f, p)
    assert last.shape == (1, fast.vocab_size)
    close(last[0], full[-1])
    assert fast.length(f) == len(p)
    r = ref.new_sequence()
    ref.forward_last(r, p)              # the reference path honours last_only too
    close(fast.step([f], [7]), ref.step([r], [7]))


def test_ragged_step_matches_for_every_batch_size(pair):
    ref, fast = pair
    ps = prompts(8, seed=4)
    rs, fs = [ref.new_sequence() for _ in ps], [fast.new_sequence() for _ in ps]
    for r, f, p in zip(rs, fs, ps):
        ref.forward(r, p)
        fast.forward(f, p)
    rng = np.random.default_rng(5)
    for B in (1, 2, 3, 5, 6, 8, 4, 7):
        idx = rng.permutation(len(ps))[:B]      # any subset, any order
        toks = rng.integers(0, 256, B).tolist()
        close(fast.step([fs[i] for i in idx], toks), ref.step([rs[i] for i in idx], toks))
    assert [fast.length(f) for f in fs] == [ref.length(r) for r in rs]


def test_batched_step_equals_solo_steps_on_the_fast_path(pair):
    _, fast = pair
    ps = prompts(6, seed=6)
    batch, solo = [fast.new_sequence() for _ in ps], [fast.new_sequence() for _ in ps]
    for s, p in zip(batch + solo, ps + ps):
        fast.forward(s, p)
    for t in range(3):
        toks = [(17 * t + i) % 256 for i in range(len(ps))]
        got = fast.step(batch, toks)
        close(got, np.concatenate([fast.step([s], [x]) for s, x in zip(solo, toks)]))


def test_truncate_then_refeed_matches_fresh_and_reference(pair):
    ref, fast = pair
    p = prompts(1, seed=7)[0]
    f = fast.new_sequence()
    fast.forward(f, p + [1, 2, 3, 4, 5])
    fast.truncate(f, len(p) + 1)
    assert fast.tokens(f) == p + [1]
    after = fast.forward(f, [11, 12, 13])
    fresh = fast.forward(fast.new_sequence(), p + [1, 11, 12, 13])
    close(after, fresh[-3:])
    r = ref.new_sequence()
    close(after, ref.forward(r, p + [1, 11, 12, 13])[-3:])
    fast.truncate(f, 2)                 # deep rollback, then a step
    ref.truncate(r, 2)
    close(fast.step([f], [9]), ref.step([r], [9]))


def test_kv_export_import_across_paths(pair):
    ref, fast = pair
    p = prompts(1, seed=8)[0]
    f = fast.new_sequence()
    fast.forward(f, p)
    r = ref.import_kv(fast.export_kv(f, dtype="float64"))     # fast -> reference
    f2 = fast.import_kv(ref.export_kv(r, dtype="float64"))    # and back
    assert ref.tokens(r) == fast.tokens(f2) == p
    out = fast.forward(f, [4, 5])
    close(ref.forward(r, [4, 5]), out)
    close(fast.forward(f2, [4, 5]), out)
    close(fast.step([f, f2], [6, 6]), np.concatenate([ref.step([r], [6])] * 2))


def test_capacity_growth_mid_sequence(pair):
    ref, fast = pair                    # caches start at 64 entries and double
    r, f = ref.new_sequence(), fast.new_sequence()
    p = prompts(1, seed=9, lo=60, hi=61)[0]
    close(fast.forward(f, p), ref.forward(r, p))
    for t in range(8):                  # crosses 64 inside a step
        close(fast.step([f], [t]), ref.step([r], [t]))
    close(fast.forward(f, list(range(70))), ref.forward(r, list(range(70))))   # grows again


def test_forward_cached_equals_forward_on_the_module():
    model = make_model("qwen2-gqa4")
    toks = torch.tensor([prompts(1, seed=10, lo=12, hi=13)[0]])
    with torch.inference_mode():
        want, _ = model(toks)
        kv = SequenceKV(model.cfg.num_layers, model.cfg.num_kv_heads, model.cfg.head_dim, torch.float64)
        cache = BatchCache([kv], toks.shape[1])
        got = model.forward_cached(toks, cache)
        assert kv.length == 0           # nothing is committed until the call succeeds
        cache.commit()
        assert kv.length == toks.shape[1]
        last = model.forward_cached(toks[:, :1], BatchCache([kv], 1), last_only=True)
        want2, _ = model(toks[:, :1], past=kv.past())
    close(got.numpy(), want.numpy())
    close(last.numpy(), want2[:, -1:].numpy())


def test_from_state_dict_shares_tensors_and_equals_the_original():
    model = make_model("qwen2-bias").float()   # the rebuilt inv_freq is float32, as in Transformer()
    sd = model.state_dict()
    clone = Transformer.from_state_dict(model.cfg, sd)
    assert clone.model.layers[0].self_attn.q_proj.weight.data_ptr() == sd["model.layers.0.self_attn.q_proj.weight"].data_ptr()
    toks = torch.tensor([[1, 2, 3, 4]])
    with torch.inference_mode():
        assert torch.equal(clone(toks)[0], model(toks)[0])
    with pytest.raises(RuntimeError):
        Transformer.from_state_dict(model.cfg, {k: v for k, v in sd.items() if "norm" not in k})


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 1e-3)])
@pytest.mark.parametrize("n,k", [(300, 96), (96, 1000), (64, 3000)])   # wide, tall-K, very tall-K
def test_fast_linear_equals_f_linear(dtype, tol, n, k, threads):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(n, k, generator=g, dtype=dtype)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for rows in range(1, 9):
            for b in (None, torch.randn(n, generator=g, dtype=dtype)):
                x = torch.randn(1, rows, k, generator=g, dtype=dtype)
                y = fast_linear(x, w, b)
                assert y.shape == (1, rows, n) and y.is_contiguous()
                torch.testing.assert_close(y, F.linear(x, w, b), rtol=0, atol=tol)
    finally:
        torch.set_num_threads(before)


def test_float32_fast_path_is_close_to_reference():
    model = make_model("llama-gqa").float()
    ref, fast = TorchEngine(model, fast=False, threads=1), TorchEngine(model, fast=True, threads=1)
    p = prompts(1, seed=11)[0]
    r, f = ref.new_sequence(), fast.new_sequence()
    a, b = ref.forward(r, p + [1, 2, 3]), fast.forward(f, p + [1, 2, 3])
    assert a.dtype == b.dtype == np.float32
    np.testing.assert_allclose(b, a, rtol=0, atol=1e-4)


def test_engine_calls_run_at_their_own_thread_count():
    model = make_model("llama-gqa")
    before = torch.get_num_threads()
    seen = []
    orig = model.forward_cached
    model.forward_cached = lambda *a, **kw: (seen.append(torch.get_num_threads()), orig(*a, **kw))[1]
    try:
        torch.set_num_threads(3)
        e = TorchEngine(model, threads=2)
        seqs = [e.new_sequence() for _ in range(6)]
        e.forward(seqs[0], list(range(12)))        # a prefill: the engine's threads
        e.forward(seqs[0], [1, 2, 3])              # a verify call: memory-bound, one thread
        e.step(seqs[:1], [4])
        e.step(seqs, [5] * 6)                      # six rows: the engine's threads again
        assert seen == [2, 1, 1, 2]
        assert torch.get_num_threads() == 3        # the process setting is put back
    finally:
        torch.set_num_threads(before)
    assert default_threads() >= 1


def test_forward_batch_is_one_pass_and_equals_one_call_per_sequence(pair, monkeypatch):
    """Ragged calls (padded at their end inside the pass) give the rows of one call each, asked rows
    only; the padding leaves no trace: lengths, tokens and every later call as without it."""
    ref, fast = pair
    ps = prompts(3, seed=5)
    rs, fs = [ref.new_sequence() for _ in ps], [fast.new_sequence() for _ in ps]
    for r, f, p in zip(rs, fs, ps):
        ref.forward(r, p)
        fast.forward(f, p)
    passes = []
    real = fast._cached
    monkeypatch.setattr(fast, "_cached", lambda kvs, t, last_only=False: passes.append(tuple(t.shape))
                        or real(kvs, t, last_only))
    calls = [(fs[0], [3, 4, 5, 6, 7]), (fs[1], [9], True), (fs[2], [11, 12, 13], 2)]
    out = fast.forward_batch(calls)
    assert passes == [(3, 5)]
    want = [ref.forward(rs[0], [3, 4, 5, 6, 7]), ref.forward_last(rs[1], [9]),
            ref.forward(rs[2], [11, 12, 13])[-2:]]
    for got, w in zip(out, want):
        assert got.shape == w.shape
        close(got, w)
    for r, f in zip(rs, fs):
        assert fast.length(f) == ref.length(r) and fast.tokens(f) == ref.tokens(r)
        close(fast.forward(f, [21, 22]), ref.forward(r, [21, 22]))


def test_forward_batch_near_the_context_end_falls_back_to_one_call_each(pair):
    """Padding that would not fit the context: one call per sequence, the same rows."""
    ref, fast = pair
    f1, f2, r1, r2 = fast.new_sequence(), fast.new_sequence(), ref.new_sequence(), ref.new_sequence()
    long = prompts(1, seed=7, lo=20, hi=21)[0] * 26          # 520 tokens; the context is 512
    fast.forward(f1, long[:508])
    ref.forward(r1, long[:508])
    out = fast.forward_batch([(f1, [1, 2, 3, 4]), (f2, [5, 6, 7, 8, 9, 10])])
    close(out[0], ref.forward(r1, [1, 2, 3, 4]))
    close(out[1], ref.forward(r2, [5, 6, 7, 8, 9, 10]))
    assert fast.length(f1) == 512 and fast.length(f2) == 6
