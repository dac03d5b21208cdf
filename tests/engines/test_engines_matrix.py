"""The Engine contract on every backend, and the roles running across backends.

Backends: torch (edge/model/transformer.py), onnx (a graph from export/onnx.py) and
llamacpp (an F32 GGUF from export/gguf.py), all holding the same tiny llama.
Contract checks compare a backend with itself: forward in pieces == one call,
a ragged batched step == single steps, truncate + refeed == a fresh run.
torch and onnx must agree to float32 rounding (1e-5 of the logit scale);
llama.cpp runs other kernels for one- and multi-token calls (docs/models.md), so
it gets a looser 1e-3 and the same argmax. Across backends the roles are
checked by their rules: a speculative run's every token is the argmax of
the target's own logits (whatever the draft backend), and a SUN prefill
module on one backend hands its KV to a decoder on another.
"""
import numpy as np
import pytest

from edge.engines.base import EngineError
from edge.engines.loader import load_engine
from edge.engines.torch_engine import TorchEngine
from edge.speculative.generate import ModelDrafter, generate_plain, generate_speculative

BACKENDS = ["torch", "onnx", "llamacpp"]
REL = {"torch": 1e-5, "onnx": 1e-5, "llamacpp": 1e-3}


def needs_llamacpp(backend):
    if backend == "llamacpp":
        pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (pip install .[llama])")


def make(exports, backend, arch="llama", seed=0, kind="model"):
    needs_llamacpp(backend)
    fp = exports.fingerprint(arch, seed)
    if backend == "torch":
        return TorchEngine(exports.model(arch, seed), fingerprint=fp)
    if backend == "onnx":
        return load_engine(exports.onnx(arch, kind, seed), backend="onnx", device="cpu", threads=1)
    return load_engine(exports.gguf(arch, "F32", seed), backend="llamacpp", threads=1, max_len=256,
                       n_seq_max=12, fingerprint=fp)


def close(got, want, rel):
    scale = max(1.0, float(np.abs(want).max()))
    err = float(np.abs(np.asarray(got, np.float64) - np.asarray(want, np.float64)).max())
    assert err <= rel * scale, f"max |diff| {err:.3g} > {rel:g} * {scale:.3g}"
    np.testing.assert_array_equal(np.argmax(got, -1), np.argmax(want, -1))


def prompts(n, seed=1, vocab=300):
    rng = np.random.default_rng(seed)
    return [rng.integers(3, vocab, size=int(rng.integers(2, 18))).tolist() for _ in range(n)]


@pytest.fixture(params=BACKENDS)
def engine(request, exports):
    return request.param, make(exports, request.param)


# -- the contract, each backend against itself ------------------------------------------------------

def test_forward_in_pieces_equals_one_call(engine):
    b, e = engine
    toks = prompts(1)[0] + [5, 6, 7, 8]
    full = e.forward(e.new_sequence(), toks)
    s = e.new_sequence()
    parts = [e.forward(s, toks[:3]), e.forward(s, toks[3:7]), e.forward(s, toks[7:])]
    close(np.concatenate(parts), full, REL[b])
    assert e.length(s) == len(toks) and full.shape == (len(toks), e.vocab_size)


def test_ragged_step_equals_single_steps(engine):
    b, e = engine
    ps = prompts(5, seed=2)
    batch, solo = [e.new_sequence() for _ in ps], [e.new_sequence() for _ in ps]
    for s, p in zip(batch + solo, ps + ps):
        e.forward(s, p)
    rng = np.random.default_rng(7)
    for _ in range(3):
        toks = rng.integers(3, 300, size=len(ps)).tolist()
        got = e.step(batch, toks)
        want = np.stack([e.step([s], [t])[0] for s, t in zip(solo, toks)])
        close(got, want, REL[b])
    # a subset, in another order
    got = e.step([batch[3], batch[0]], [9, 10])
    close(got, np.stack([e.step([solo[3]], [9])[0], e.step([solo[0]], [10])[0]]), REL[b])
    assert [e.length(s) for s in batch] == [len(p) + 3 + (i in (0, 3)) for i, p in enumerate(ps)]


def test_truncate_then_refeed_equals_fresh_run(engine):
    b, e = engine
    p = prompts(1, seed=4)[0]
    s = e.new_sequence()
    e.forward(s, p + [11, 12, 13, 14])
    e.truncate(s, len(p) + 1)
    assert e.length(s) == len(p) + 1
    after = e.forward(s, [21, 22])
    fresh = e.forward(e.new_sequence(), p + [11, 21, 22])
    close(after, fresh[-2:], REL[b])
    e.truncate(s, 0)
    close(e.forward(s, p), fresh[: len(p)], REL[b])


def test_clear_errors(engine):
    b, e = engine
    s = e.new_sequence()
    with pytest.raises(EngineError, match="vocabulary"):
        e.forward(s, [e.vocab_size + 5])
    with pytest.raises(EngineError, match="unknown sequence"):
        e.step([987654], [1])
    with pytest.raises(EngineError, match="cannot truncate"):
        e.truncate(s, 3)
    with pytest.raises(EngineError, match="context"):
        e.forward(s, [5] * (e.max_len + 1))
    e.free(s)
    with pytest.raises(EngineError, match="unknown sequence"):
        e.forward(s, [1])


@pytest.mark.parametrize("backend", ["onnx", "llamacpp"])
def test_backends_agree_with_torch(exports, backend):
    """Same weights on another runtime: close logits (llama.cpp keeps f16 KV: looser)."""
    t, e = make(exports, "torch"), make(exports, backend)
    p = prompts(1, seed=5)[0]
    want = np.concatenate([t.forward(ts := t.new_sequence(), p), t.forward(ts, [7, 8])])
    got = np.concatenate([e.forward(es := e.new_sequence(), p), e.forward(es, [7, 8])])
    rel = {"onnx": 1e-4, "llamacpp": 2e-2}[backend]
    scale = max(1.0, float(np.abs(want).max()))
    assert np.abs(got - want).max() <= rel * scale
    assert (got.argmax(-1) == want.argmax(-1)).mean() >= 0.9


# -- StarSD roles across backends ------------------------------------------------------------------

class Recorder:
    """Wraps a target engine and keeps, per absolute position, the argmax of its latest logits there."""

    def __init__(self, engine):
        self.e = engine
        self.argmax = {}

    def __getattr__(self, name):
        return getattr(self.e, name)

    def _record(self, seq, tokens, call):
        end = self.e.length(seq) + len(tokens)
        out = call()                                    # the last len(out) positions' rows
        for i, row in enumerate(out):
            self.argmax[end - len(out) + i] = int(np.argmax(row))
        return out

    def forward(self, seq, tokens):
        return self._record(seq, tokens, lambda: self.e.forward(seq, tokens))

    def forward_last(self, seq, tokens):
        return self._record(seq, tokens, lambda: self.e.forward_last(seq, tokens))

    def forward_tail(self, seq, tokens, n_rows):
        return self._record(seq, tokens, lambda: self.e.forward_tail(seq, tokens, n_rows))

    def forward_rows(self, seq, tokens, n_rows):
        return self._record(seq, tokens, lambda: self.e.forward_rows(seq, tokens, n_rows))

    def step(self, seqs, tokens):
        starts = [self.e.length(s) for s in seqs]
        out = self.e.step(seqs, tokens)
        for st, row in zip(starts, out):
            self.argmax[st] = int(np.argmax(row))
        return out


@pytest.mark.parametrize("target_b,draft_b,draft_seed", [
    ("onnx", "torch", 0), ("onnx", "llamacpp", 0), ("llamacpp", "onnx", 0), ("torch", "onnx", 1),
])
def test_speculative_across_backends_is_lossless(exports, target_b, draft_b, draft_seed):
    target, draft = Recorder(make(exports, target_b)), make(exports, draft_b, seed=draft_seed)
    p = prompts(1, seed=6)[0]
    res = generate_speculative(target, ModelDrafter(draft), p, 40, gamma=3)
    assert res.n_generated == 40 and res.n_drafted > 0
    if draft_seed == 0:
        assert res.n_accepted > 0  # the same weights on another runtime mostly agree
    # the rule: every committed token is the target's own argmax at its position
    full = p + res.tokens
    for pos in range(len(p), len(full)):
        assert full[pos] == target.argmax[pos - 1], f"token {pos} is not the target's greedy choice"
    if target_b != "llamacpp":  # float backends: also token-for-token the plain greedy text
        assert res.tokens == generate_plain(make(exports, target_b), p, 40).tokens


# -- SUN roles across backends ---------------------------------------------------------------------

@pytest.mark.parametrize("prefill_b,decoder_b", [("onnx-prefill", "torch"), ("torch", "onnx-decoder"),
                                                 ("onnx-model", "onnx-decoder"), ("llamacpp", "torch"),
                                                 ("torch", "llamacpp"), ("onnx-prefill", "llamacpp")])
def test_sun_prefill_and_decoder_across_backends(exports, prefill_b, decoder_b):
    from edge.sun.decoder import SharedDecoder
    from edge.sun.prefill import PrefillWorker
    from edge.model.sun_modules import split_generate
    dec_fp = exports.fingerprint("llama", 1)

    def eng(spec, seed):
        if spec == "torch":
            return TorchEngine(exports.model("llama", seed), fingerprint=dec_fp)
        if spec == "llamacpp":   # an F32 cache without flash attention: float32 rounding, token for token
            needs_llamacpp(spec)
            return load_engine(exports.gguf("llama", "F32", seed), backend="llamacpp", threads=1, max_len=256,
                               fingerprint=dec_fp, kv_type="f32", flash_attn=False)
        return load_engine(exports.onnx("llama", spec.split("-")[1], seed), backend="onnx", device="cpu",
                           fingerprint=dec_fp)

    worker = PrefillWorker(eng(prefill_b, 0), task="t", kv_dtype="float32")
    decoder = SharedDecoder(eng(decoder_b, 1), max_batch=8)
    ps = prompts(3, seed=8)
    for i, p in enumerate(ps):
        out = worker.prefill(p, request_id=f"r{i}")
        decoder.admit(out.blob, max_new=12)
    results = decoder.run()
    want = split_generate(exports.model("llama", 0), exports.model("llama", 1), ps, 12)
    assert [results[f"r{i}"].tokens for i in range(3)] == want
