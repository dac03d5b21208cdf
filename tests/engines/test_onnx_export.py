"""ONNX export (export/onnx.py) run by onnxruntime (edge/engines/onnx_engine.py) against torch.

Tolerances. fp32: ORT and torch run the same float32 math in a different
order (fused kernels, other summation trees), so logits agree to ~1e-6 of
their scale; we assert |ORT - torch| <= 1e-4 * max(1, max|logit|). int4:
the graph's MatMulNBits carries exactly quant.py's codes and scales, so ORT
computes the fake-quantised torch model up to the same float reordering; we
assert the same 1e-4 bound against torch + fake_quant_state_dict, and that the
gap to the unquantised model is at least 100x larger (it really is int4).
"""
import numpy as np
import onnx
import pytest
import torch

from edge.engines.base import EngineError
from edge.engines.onnx_engine import OnnxEngine
from edge.engines.torch_engine import TorchEngine
from edge.model.transformer import Transformer
from export.onnx import OnnxExportError, artifact_files, export_onnx, input_names, int4_names, output_names
from export.quant import fake_quant_state_dict, quantize_q4, to_matmulnbits

ARCHS = ["llama", "qwen2"]


def close(got, want, rel=1e-4):
    scale = max(1.0, float(np.abs(want).max()))
    err = float(np.abs(np.asarray(got, np.float64) - np.asarray(want, np.float64)).max())
    assert err <= rel * scale, f"max |diff| {err:.3g} > {rel:g} * {scale:.3g}"
    return err


def torch_engine(model, fp="x"):
    return TorchEngine(model, fingerprint=fp)


def prompts(n, seed=1, vocab=300):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, size=int(rng.integers(2, 20))).tolist() for _ in range(n)]


def fake_quant_model(model, lm_head=False):
    """The torch model QSUN trains against: quant.py's projections (and lm_head) on the int4 grid."""
    cfg = model.cfg
    names = [n for n in int4_names(model) if n != "lm_head.weight"]
    sd = fake_quant_state_dict(model.state_dict(), names)
    if lm_head:
        from dataclasses import replace
        cfg = replace(cfg, tie_embeddings=False)
        sd["lm_head.weight"] = fake_quant_state_dict({"w": model.output_weight().detach()}, ["w"])["w"]
    m = Transformer(cfg).eval()
    m.load_state_dict(sd)
    return m


# -- graph interface --------------------------------------------------------------------------------

def test_names_and_dynamic_axes(exports):
    g = onnx.load(str(exports.onnx("llama")), load_external_data=False).graph
    L = exports.model("llama").cfg.num_layers
    assert [i.name for i in g.input] == input_names("model", L)
    assert [o.name for o in g.output] == output_names(L)
    dims = {v.name: [d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim]
            for v in list(g.input) + list(g.output)}
    assert dims["input_ids"] == ["batch_size", "sequence_length"]
    assert dims["attention_mask"] == ["batch_size", "total_sequence_length"]
    assert dims["past_key_values.1.value"] == ["batch_size", 2, "past_sequence_length", 16]
    assert dims["present.0.key"][2] == "total_sequence_length"
    assert dims["logits"] == ["batch_size", "sequence_length", exports.VOCAB]
    p = onnx.load(str(exports.onnx("llama", "prefill")), load_external_data=False).graph
    assert [i.name for i in p.input] == ["input_ids", "attention_mask"]
    assert [d.dim_value for d in p.output[0].type.tensor_type.shape.dim][1:] == [1, exports.VOCAB]


# -- fp32: every graph close to torch ----------------------------------------------------------------

@pytest.mark.parametrize("arch", ARCHS)
def test_model_graph_matches_torch_prefill_verify_and_steps(exports, arch):
    m = exports.model(arch)
    t, o = torch_engine(m), OnnxEngine(exports.onnx(arch), device="cpu", threads=1)
    p = prompts(1)[0]
    ts, os_ = t.new_sequence(), o.new_sequence()
    close(o.forward(os_, p), t.forward(ts, p))                    # prefill from an empty cache
    close(o.forward(os_, [7, 8, 9, 10]), t.forward(ts, [7, 8, 9, 10]))  # verify 4 tokens at once
    for tok in (3, 4, 5):
        close(o.step([os_], [tok]), t.step([ts], [tok]))


@pytest.mark.parametrize("arch", ARCHS)
def test_ragged_batched_step_matches_torch(exports, arch):
    m = exports.model(arch)
    t, o = torch_engine(m), OnnxEngine(exports.onnx(arch), device="cpu", threads=1)
    ps = prompts(5, seed=2)
    tseqs, oseqs = [t.new_sequence() for _ in ps], [o.new_sequence() for _ in ps]
    for a, b, p in zip(tseqs, oseqs, ps):
        t.forward(a, p)
        o.forward(b, p)
    rng = np.random.default_rng(3)
    for _ in range(3):
        toks = rng.integers(0, 300, size=len(ps)).tolist()
        close(o.step(oseqs, toks), t.step(tseqs, toks))
    assert [o.length(s) for s in oseqs] == [len(p) + 3 for p in ps]


@pytest.mark.parametrize("arch", ARCHS)
def test_prefill_graph_gives_last_logits_and_the_kv(exports, arch):
    m = exports.model(arch)
    t, pre = torch_engine(m, exports.fingerprint(arch)), OnnxEngine(exports.onnx(arch, "prefill"), device="cpu")
    assert pre.fingerprint == exports.fingerprint(arch) and pre.last_logits_only
    p = prompts(1, seed=4)[0]
    ts, ps = t.new_sequence(), pre.new_sequence()
    want = t.forward(ts, p)
    got = pre.forward(ps, p)
    close(got[-1], want[-1])
    assert np.isnan(got[:-1]).all()  # rows this graph does not compute are NaN, never stale numbers
    with pytest.raises(EngineError, match="prefill-only"):
        pre.forward(ps, [1])
    # its KV continues in torch exactly like torch's own
    cont = t.import_kv(pre.export_kv(ps, dtype="float32"))
    close(t.forward(cont, [5, 6]), t.forward(ts, [5, 6]))


def test_prefill_graph_takes_a_right_padded_batch(exports):
    """The graph itself (as other tools would call it): each row's last real token, its own KV."""
    import onnxruntime as ort
    m = exports.model("qwen2")
    sess = ort.InferenceSession(str(exports.onnx("qwen2", "prefill")), providers=["CPUExecutionProvider"])
    rows = prompts(3, seed=11)
    T = max(map(len, rows))
    ids = np.zeros((3, T), np.int64)
    mask = np.zeros((3, T), np.int64)
    for i, r in enumerate(rows):
        ids[i, : len(r)], mask[i, : len(r)] = r, 1
    out = sess.run(None, {"input_ids": ids, "attention_mask": mask})
    assert out[0].shape == (3, 1, exports.VOCAB) and out[1].shape == (3, 2, T, 16)
    for i, r in enumerate(rows):
        with torch.inference_mode():
            want, kv = m(torch.tensor([r]))
        close(out[0][i, 0], want[0, -1].numpy())
        close(out[1][i, :, : len(r)], kv[0][0][0].numpy())


@pytest.mark.parametrize("arch", ARCHS)
def test_decoder_graph_continues_a_kv_blob_from_another_module(exports, arch):
    """SUN: prefill module A's KV, decoder B (other weights, same graph) continues it."""
    a, b = exports.model(arch, seed=0), exports.model(arch, seed=1)
    dec_fp = exports.fingerprint(arch, seed=1)
    pre = OnnxEngine(exports.onnx(arch, "prefill"), device="cpu", fingerprint=dec_fp)
    dec = OnnxEngine(exports.onnx(arch, "decoder", seed=1), device="cpu")
    assert dec.graph == "decoder" and dec.fingerprint == dec_fp
    p = prompts(1, seed=5)[0]
    s = pre.new_sequence()
    pre.forward(s, p)
    blob = pre.export_kv(s, dtype="float32")
    d = dec.import_kv(blob)
    got = np.concatenate([dec.forward(d, [9, 10]), dec.step([d], [11])])
    # torch reference: A's KV, B's layers
    with torch.inference_mode():
        _, kv = a(torch.tensor([p]))
        want, _ = b(torch.tensor([[9, 10, 11]]), past=kv)
    close(got, want[0].numpy())
    other = OnnxEngine(exports.onnx(arch, "decoder", seed=0), device="cpu")  # decoder A refuses B's blob
    with pytest.raises(EngineError, match="made for model"):
        other.import_kv(blob)


@pytest.mark.parametrize("arch", ARCHS)
def test_kv_blobs_move_between_torch_and_onnx(exports, arch):
    m = exports.model(arch)
    fp = exports.fingerprint(arch)
    t, o = torch_engine(m, fp), OnnxEngine(exports.onnx(arch), device="cpu")
    p = prompts(1, seed=6)[0]
    ts = t.new_sequence()
    t.forward(ts, p)
    os_ = o.import_kv(t.export_kv(ts, dtype="float32"))
    assert o.tokens(os_) == p and o.length(os_) == len(p)
    close(o.forward(os_, [1, 2]), t.forward(ts, [1, 2]))
    back = t.import_kv(o.export_kv(os_, dtype="float32"))
    close(t.forward(back, [3]), o.forward(os_, [3]))


def test_greedy_64_tokens_identical_fp32(exports):
    from edge.speculative.generate import generate_plain
    m = exports.model("qwen2")
    p = prompts(1, seed=7)[0]
    want = generate_plain(torch_engine(m), p, 64).tokens
    got = generate_plain(OnnxEngine(exports.onnx("qwen2"), device="cpu"), p, 64).tokens
    assert len(want) == 64 and got == want


# -- int4 -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("arch", ARCHS)
def test_int4_graph_computes_the_fake_quant_model(exports, arch):
    m = exports.model(arch)
    q = OnnxEngine(exports.onnx(arch, int4=True), device="cpu")
    assert q.quant == "int4-q4_0-g32" and q.extra["int4_weights"] == 7 * m.cfg.num_layers
    fq, fp = torch_engine(fake_quant_model(m)), torch_engine(m)
    p = prompts(1, seed=8)[0]
    a, b, c = q.new_sequence(), fq.new_sequence(), fp.new_sequence()
    got = np.concatenate([q.forward(a, p), q.step([a], [3])])
    want = np.concatenate([fq.forward(b, p), fq.step([b], [3])])
    full = np.concatenate([fp.forward(c, p), fp.step([c], [3])])
    err = close(got, want)
    assert np.abs(got - full).max() > 100 * max(err, 1e-7)


def test_int4_initializers_are_quant_py_codes(exports):
    """The graph stores exactly to_matmulnbits(quantize_q4(w)), and the node reads it that way."""
    m = exports.model("llama")
    g = onnx.load(str(exports.onnx("llama", int4=True))).graph
    inits = {t.name: onnx.numpy_helper.to_array(t) for t in g.initializer}
    name = "model.layers.1.mlp.down_proj.weight"
    b, scales, zp = to_matmulnbits(quantize_q4(m.state_dict()[name]))
    np.testing.assert_array_equal(inits[f"m.{name}::q4"], b)
    np.testing.assert_array_equal(inits[f"m.{name}::q4_scales"], scales)
    np.testing.assert_array_equal(inits[f"m.{name}::q4_zp"], zp)
    node = next(n for n in g.node if n.op_type == "MatMulNBits" and n.input[1] == f"m.{name}::q4")
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
    assert attrs["bits"] == 4 and attrs["block_size"] == 32 and attrs["accuracy_level"] == 0
    assert (attrs["N"], attrs["K"]) == tuple(m.state_dict()[name].shape)


def test_int4_lm_head_unties_and_quantises_the_output(exports):
    m = exports.model("llama")  # tied embeddings
    q = OnnxEngine(exports.onnx("llama", int4=True, int4_lm_head=True), device="cpu")
    assert q.extra["int4_weights"] == 7 * m.cfg.num_layers + 1
    fq = torch_engine(fake_quant_model(m, lm_head=True))
    p = prompts(1, seed=9)[0]
    close(q.forward(q.new_sequence(), p), fq.forward(fq.new_sequence(), p))


def test_fake_quant_weights_export_to_the_same_grid(exports, tmp_path):
    """A QSUN decoder is saved fake-quantised; re-quantising it must give the same int4 graph."""
    m = exports.model("qwen2")
    fq = fake_quant_model(m)
    path = export_onnx(fq, tmp_path / "fq.onnx", int4=True)
    a = {t.name: onnx.numpy_helper.to_array(t) for t in onnx.load(str(path)).graph.initializer}
    b = {t.name: onnx.numpy_helper.to_array(t)
         for t in onnx.load(str(exports.onnx("qwen2", int4=True))).graph.initializer}
    for k in a:
        if "::q4" in k:
            np.testing.assert_array_equal(a[k], b[k], err_msg=k)


# -- files -------------------------------------------------------------------------------------------

def test_external_data_and_errors(exports, tmp_path):
    path = exports.onnx("llama", external_data=True)
    files = artifact_files(path)
    assert len(files) == 2 and files[1].name == path.name + ".data" and files[1].stat().st_size > 100_000
    m = exports.model("llama")
    o, t = OnnxEngine(path, device="cpu"), torch_engine(m)
    p = prompts(1, seed=10)[0]
    close(o.forward(o.new_sequence(), p), t.forward(t.new_sequence(), p))
    with pytest.raises(OnnxExportError, match="unknown graph"):
        export_onnx(m, tmp_path / "x.onnx", kind="encoder")
    with pytest.raises(OnnxExportError, match="float32"):
        export_onnx(m.double(), tmp_path / "x.onnx")
    m.float()
    with pytest.raises(EngineError, match="cannot load"):
        OnnxEngine(tmp_path / "missing.onnx", device="cpu")


# -- the real model ----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def smollm2(module_tmp_path):
    from edge.model.fetch import model_path
    if not model_path("smollm2-135m").exists():
        pytest.skip("SmolLM2-135M is not fetched (run `make models`)")
    from edge.model.checkpoint import load_model
    model, ckpt = load_model("smollm2-135m")
    d = module_tmp_path
    paths = {k: export_onnx(model, d / f"{k}.onnx", kind=k, fingerprint=ckpt.fingerprint)
             for k in ("model", "prefill")}
    # the third graph as SUN deploys it: an int4 shared decoder (QSUN grid)
    paths["decoder"] = export_onnx(model, d / "decoder.int4.onnx", kind="decoder", int4=True,
                                   fingerprint=ckpt.fingerprint)
    yield model, ckpt, paths


def test_smollm2_three_graphs_match_torch_and_greedy_is_identical(smollm2):
    from edge.speculative.generate import generate_plain
    model, ckpt, paths = smollm2
    t = torch_engine(model, ckpt.fingerprint)
    o = OnnxEngine(paths["model"], device="cpu")
    pre = OnnxEngine(paths["prefill"], device="cpu")
    p = ckpt.tokenizer.encode("The capital of France is Paris. The capital of Italy is")
    ts, os_, ps = t.new_sequence(), o.new_sequence(), pre.new_sequence()
    want = t.forward(ts, p)
    close(o.forward(os_, p), want)
    close(pre.forward(ps, p)[-1], want[-1])
    close(o.forward(os_, [28, 30]), t.forward(ts, [28, 30]))
    # int4 decoder continuing the fp32 prefill graph's KV == torch fake-quant decoder on torch's KV
    dec = OnnxEngine(paths["decoder"], device="cpu")
    assert dec.graph == "decoder" and dec.quant == "int4-q4_0-g32"
    d = dec.import_kv(pre.export_kv(ps, dtype="float32"))
    with torch.inference_mode():
        _, kv = model(torch.tensor([p]))
        ref, _ = fake_quant_model(model)(torch.tensor([[28, 30]]), past=kv)
    close(dec.forward(d, [28, 30]), ref[0].numpy())
    # 32 tokens of the real model (the tiny models' graphs run 64: test_greedy_64_tokens_identical_fp32)
    g_t = generate_plain(t, p, 32).tokens
    g_o = generate_plain(o, p, 32).tokens
    assert g_o == g_t
