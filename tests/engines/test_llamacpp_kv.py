"""KV blobs in and out of llama.cpp (edge/engines/llamacpp_kv.py + LlamaCppEngine.export_kv/import_kv).

The conversion is checked on its own (build -> parse is the identity for every layout
llama.cpp writes, the RoPE dim permutation is the converter's), then against torch on
tiny llama / qwen2 GGUFs: the KV llama.cpp computes equals torch's, and a blob crossing
either way continues with the logits the other backend computes. With an F32 cache the
match is to float32 rounding; with llama.cpp's default F16 cache to F16 rounding.
"""
import numpy as np
import pytest

from edge.engines.base import EngineError
from edge.engines.llamacpp_kv import Layout, StateError, build_state, parse_state, permute_k
from edge.engines.torch_engine import TorchEngine

TAG = b"\xd8<\x14\xaf"


def random_kv(n=5, layers=3, heads=2, hd=8, seed=0):
    return np.random.default_rng(seed).normal(size=(layers, 2, heads, n, hd)).astype(np.float32)


@pytest.mark.parametrize("v_trans", [False, True])
@pytest.mark.parametrize("permuted", [False, True])
def test_build_then_parse_is_the_identity(v_trans, permuted):
    kv = random_kv()
    for ggml_type, tol in ((0, 0.0), (1, 2e-3)):
        lay = Layout(TAG, n_stream=4, v_trans=v_trans, k_type=ggml_type, v_type=ggml_type)
        raw = build_state(kv, lay, slot=2, permuted=permuted)
        got, seen = parse_state(raw, 3, 2, 8, permuted)
        assert seen == lay
        np.testing.assert_allclose(got, kv, rtol=tol, atol=tol)
    assert parse_state(build_state(kv[:, :, :, :0], lay, 0, permuted), 3, 2, 8, permuted)[0].shape[3] == 0


def test_rope_permutation_is_the_converters():
    k = np.arange(2 * 3 * 8, dtype=np.float32).reshape(2, 3, 8)
    hf = permute_k(k, to_hf=True)
    for i in range(4):
        for j in range(2):
            np.testing.assert_array_equal(hf[..., j * 4 + i], k[..., 2 * i + j])
    np.testing.assert_array_equal(permute_k(hf, to_hf=False), k)


def test_malformed_state_is_refused_with_a_reason():
    lay = Layout(TAG, 2, False, 0, 0)
    raw = build_state(random_kv(), lay, 0, False)
    with pytest.raises(StateError, match="ends early"):
        parse_state(raw[:-3], 3, 2, 8, False)
    with pytest.raises(StateError, match="trailing"):
        parse_state(raw + b"\0", 3, 2, 8, False)
    with pytest.raises(StateError, match="layer count"):
        parse_state(raw, 4, 2, 8, False)
    with pytest.raises(StateError, match="F32/F16"):
        build_state(random_kv(), Layout(TAG, 2, False, 8, 8), 0, False)   # Q8_0 cache


# -- against torch, through llama.cpp --------------------------------------------------------------

# llama.cpp's CPU flash attention works in F16 inside: later layers' K/V are F16-close even in an F32 cache
CACHES = [("f32", False, 1e-5), ("f32", True, 1e-3), ("f16", None, 3e-3)]


def engines(exports, arch, kv_type, flash):
    pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (pip install .[llama])")
    from edge.engines.llamacpp_engine import LlamaCppEngine
    fp = exports.fingerprint(arch)
    lcpp = LlamaCppEngine(exports.gguf(arch, "F32"), max_len=64, n_seq_max=4, threads=1, fingerprint=fp,
                          kv_type=kv_type, flash_attn=flash)
    return TorchEngine(exports.model(arch), fingerprint=fp), lcpp


def close(got, want, rel):
    scale = max(1.0, float(np.abs(want).max()))
    assert float(np.abs(np.asarray(got) - np.asarray(want)).max()) <= rel * scale


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("kv_type,flash,rel", CACHES)
def test_kv_crosses_between_llamacpp_and_torch(exports, arch, kv_type, flash, rel):
    from edge.model.kv import SequenceKV
    t, e = engines(exports, arch, kv_type, flash)
    prompt = [5, 17, 99, 3, 250, 41, 8]
    ts, es = t.new_sequence(), e.new_sequence()
    t.forward(ts, prompt)
    e.forward(es, prompt)
    mine, _ = SequenceKV.from_bytes(e.export_kv(es, dtype="float32"))
    ref, _ = SequenceKV.from_bytes(t.export_kv(ts, dtype="float32"))
    close(mine.data[:, :, :, :7].numpy(), ref.data[:, :, :, :7].numpy(), rel)
    assert e.tokens(es) == prompt and mine.length == 7
    # torch's KV continues in llama.cpp as llama.cpp's own does, and as torch does
    imported = e.import_kv(t.export_kv(ts, dtype="float32"))
    assert e.length(imported) == 7 and e.tokens(imported) == prompt
    got = e.step([es, imported], [12, 12])
    want = t.step([ts], [12])[0]
    for row in got:
        close(row, want, rel)
        assert int(np.argmax(row)) == int(np.argmax(want))
    # and llama.cpp's KV continues in torch
    back = t.import_kv(e.export_kv(imported, dtype="float32"))
    close(t.step([back], [13])[0], e.step([imported], [13])[0], rel)


def test_bad_blobs_are_refused_and_the_engine_keeps_serving(exports):
    t, e = engines(exports, "llama", "f16", None)
    ts = t.new_sequence()
    t.forward(ts, [5, 6, 7])
    blob = t.export_kv(ts)
    other = TorchEngine(exports.model("llama"), fingerprint="another-model")
    os_ = other.new_sequence()
    other.forward(os_, [5, 6, 7])
    with pytest.raises(EngineError, match="made for model"):
        e.import_kv(other.export_kv(os_))
    with pytest.raises(EngineError, match="truncated"):
        e.import_kv(blob[:-5])
    assert e.active_sequences == 0                      # a refused blob holds no slot
    held = [e.import_kv(blob) for _ in range(4)]
    with pytest.raises(EngineError, match="slots are in use"):
        e.import_kv(blob)
    e.free(held[0])
    s = e.import_kv(blob)
    assert e.length(s) == 3 and e.step([s], [9]).shape == (1, e.vocab_size)
