"""Bundles (export/bundle.py + edge/engines/loader.py): built, validated, loaded by role; bad ones refused."""
import json
import shutil

import numpy as np
import pytest
from safetensors.torch import save_file

from edge.engines.base import EngineError
from edge.engines.loader import BundleError, load_engine, validate_bundle
from edge.engines.torch_engine import TorchEngine
from export.bundle import build_bundle, describe


def hf_dir(path, model, tokenizer):
    """A Hugging Face style checkpoint directory of a tiny model."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(model.cfg.to_hf()))
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(path / "model.safetensors"))
    tokenizer.save(path)
    return path


@pytest.fixture(scope="module")
def bundle(exports, tmp_path_factory):
    root = tmp_path_factory.mktemp("bundle")
    src = hf_dir(root / "tiny-llama", exports.model("llama"), exports.tokenizer())
    out = root / "out"
    build_bundle(src, out, onnx_graphs=("model", "prefill"), int4=True, gguf_types=("Q4_0",), log=lambda *_: None)
    return src, out


def copy(bundle_dir, tmp_path):
    dst = tmp_path / "b"
    shutil.copytree(bundle_dir, dst)
    return dst


def test_manifest_records_artifacts_fingerprints_and_memory(bundle):
    src, out = bundle
    man = validate_bundle(out)
    names = [a["name"] for a in man["artifacts"]]
    assert names == ["tiny-llama.model.fp32", "tiny-llama.model.int4", "tiny-llama.prefill.fp32",
                     "tiny-llama.prefill.int4", "tiny-llama.q4_0"]
    from edge.model.checkpoint import load_checkpoint
    ck = load_checkpoint(src)
    for a in man["artifacts"]:
        assert a["fingerprint"] == a["kv_fingerprint"] == ck.fingerprint
        assert a["tokenizer_fingerprint"] == ck.tokenizer.fingerprint() == man["tokenizer"]["fingerprint"]
        assert all(len(f["sha256"]) == 64 and f["bytes"] > 0 for f in a["files"])
        mem = a["memory"]
        assert mem["weights_bytes"] == sum(f["bytes"] for f in a["files"])
        kv_item = 4 if a["backend"] == "onnx" else 2
        assert mem["kv_bytes_per_1k_tokens"] == 2 * 2 * 2 * 16 * kv_item * 1000  # layers*k/v*heads*dim
        assert set(mem["roles"]) == {"draft", "target", "prefill", "decoder"}
    by = {a["name"]: a for a in man["artifacts"]}
    assert by["tiny-llama.model.int4"]["quant"] == "int4-q4_0-g32"
    assert by["tiny-llama.prefill.fp32"]["roles"] == ["prefill"]
    assert by["tiny-llama.q4_0"]["backend"] == "gguf"
    assert by["tiny-llama.model.int4"]["memory"]["weights_bytes"] < by["tiny-llama.model.fp32"]["memory"]["weights_bytes"]
    assert len(describe(out)) == 5


def test_load_engine_by_role_and_backend(bundle, exports):
    _, out = bundle
    t = TorchEngine(exports.model("llama"))
    p = [5, 6, 7, 8, 9]
    want = t.forward(t.new_sequence(), p)
    e = load_engine(out, backend="onnx", role="target", device="cpu")
    assert e.graph == "model" and e.quant == "fp32" and e.artifact["name"] == "tiny-llama.model.fp32"
    np.testing.assert_allclose(e.forward(e.new_sequence(), p), want, atol=1e-4 * max(1, np.abs(want).max()))
    pre = load_engine(out, backend="onnx", role="prefill", artifact="tiny-llama.prefill.int4", device="cpu")
    assert pre.graph == "prefill" and pre.quant == "int4-q4_0-g32"
    pytest.importorskip("llama_cpp")
    g = load_engine(out, backend="llamacpp", role="draft", max_len=64, n_seq_max=2)
    assert g.fingerprint == e.fingerprint and g.vocab_size == exports.VOCAB
    # a plain model's GGUF serves the SUN roles too (its KV moves through llama.cpp's sequence state)
    assert load_engine(out, backend="llamacpp", role="decoder", max_len=64, n_seq_max=2).artifact == g.artifact
    with pytest.raises(EngineError, match="unknown role 'verifier'"):
        load_engine(out, backend="llamacpp", role="verifier")
    with pytest.raises(BundleError, match="torch backend loads checkpoints"):
        load_engine(out, backend="torch")


def test_truncated_artifact_is_refused(bundle, tmp_path):
    d = copy(bundle[1], tmp_path)
    f = d / "tiny-llama.model.fp32.onnx"
    f.write_bytes(f.read_bytes()[:-100])
    with pytest.raises(BundleError, match="truncated"):
        validate_bundle(d)
    with pytest.raises(BundleError, match="tiny-llama.model.fp32.onnx .* truncated"):
        load_engine(d, backend="onnx", role="target")
    # other artifacts of the bundle still load
    load_engine(d, backend="onnx", role="prefill", device="cpu")


def test_corrupted_artifact_is_refused(bundle, tmp_path):
    d = copy(bundle[1], tmp_path)
    f = d / "tiny-llama.q4_0.gguf"
    raw = bytearray(f.read_bytes())
    raw[len(raw) // 2] ^= 0x55  # same size, one byte changed
    f.write_bytes(bytes(raw))
    with pytest.raises(BundleError, match="corrupted"):
        load_engine(d, backend="llamacpp", role="draft")
    validate_bundle(d, deep=False)  # a size-only check cannot see it; the default deep check does


def test_mismatched_artifact_is_refused(bundle, exports, tmp_path):
    """A graph of other weights dropped in (manifest sizes/sha even updated to match) is refused."""
    from edge.engines.loader import sha256_file
    d = copy(bundle[1], tmp_path)
    target = d / "tiny-llama.model.fp32.onnx"
    shutil.copy(exports.onnx("llama", "model", seed=1), target)
    man = json.loads((d / "manifest.json").read_text())
    for a in man["artifacts"]:
        for fe in a["files"]:
            if fe["path"] == target.name:
                fe["bytes"], fe["sha256"] = target.stat().st_size, sha256_file(target)
    (d / "manifest.json").write_text(json.dumps(man))
    with pytest.raises(BundleError, match="belongs to another export"):
        load_engine(d, backend="onnx", role="target")
    with pytest.raises(BundleError, match="expected"):
        validate_bundle(bundle[1], expect_fingerprint="0" * 64)
    with pytest.raises(BundleError, match="tokenizer"):
        validate_bundle(bundle[1], expect_tokenizer="f" * 64)


def test_broken_manifests_are_refused(bundle, tmp_path):
    d = copy(bundle[1], tmp_path)
    (d / "tiny-llama.prefill.int4.onnx").unlink()
    with pytest.raises(BundleError, match="missing"):
        validate_bundle(d)
    man = json.loads((d / "manifest.json").read_text())
    (d / "manifest.json").write_text(json.dumps({**man, "version": 99}))
    with pytest.raises(BundleError, match="version 99"):
        validate_bundle(d)
    (d / "manifest.json").write_text("{not json")
    with pytest.raises(BundleError, match="not valid JSON"):
        load_engine(d, backend="onnx")
    with pytest.raises(BundleError, match="not a bundle"):
        validate_bundle(tmp_path)


def test_sun_parts_carry_the_decoder_fingerprint(exports, tmp_path):
    """A SUN decoder and a prefill module tuned for it, bundled together, serve each other."""
    from edge.sun.decoder import AdmissionError, SharedDecoder
    from edge.sun.prefill import PrefillWorker
    from edge.model.sun_modules import save_module, split_generate, weights_fingerprint
    dec_m, pre_m = exports.model("llama", 1), exports.model("llama", 0)
    dec_fp = weights_fingerprint(dec_m, "fp32")
    save_module(tmp_path / "dec", dec_m, {"kind": "sun-decoder", "precision": "fp32", "fingerprint": dec_fp})
    save_module(tmp_path / "pre", pre_m, {"kind": "sun-prefill", "decoder_fingerprint": dec_fp,
                                          "decoder_precision": "fp32"})
    out = tmp_path / "sun"
    build_bundle(tmp_path / "dec", out, onnx_graphs=("decoder",), log=lambda *_: None)
    build_bundle(tmp_path / "pre", out, onnx_graphs=("prefill",), log=lambda *_: None)
    man = validate_bundle(out)
    by = {a["graph"]: a for a in man["artifacts"]}
    assert by["decoder"]["fingerprint"] == by["decoder"]["kv_fingerprint"] == dec_fp
    assert by["prefill"]["kv_fingerprint"] == by["prefill"]["decoder_fingerprint"] == dec_fp
    assert by["prefill"]["fingerprint"] != dec_fp
    worker = PrefillWorker(load_engine(out, backend="onnx", role="prefill", device="cpu"), "t", kv_dtype="float32")
    decoder = SharedDecoder(load_engine(out, backend="onnx", role="decoder", device="cpu"))
    p = [4, 5, 6, 7, 8]
    decoder.admit(worker.prefill(p, request_id="r").blob, max_new=8)
    assert decoder.run()["r"].tokens == split_generate(pre_m, dec_m, [p], 8)[0]
    # a decoder of other weights refuses the blob
    other = SharedDecoder(TorchEngine(pre_m, fingerprint=weights_fingerprint(pre_m, "fp32")))
    with pytest.raises(AdmissionError, match="made for model"):
        other.admit(worker.prefill(p).blob, max_new=4)


def test_cli_onnx_bundle_and_show(bundle, tmp_path):
    from click.testing import CliRunner
    from export.export_cli import main
    src, _ = bundle
    r = CliRunner().invoke(main, ["onnx", str(src), str(tmp_path / "g"), "--graphs", "prefill", "--int4"])
    assert r.exit_code == 0, r.output
    assert (tmp_path / "g" / "prefill.int4.onnx").is_file()
    out = tmp_path / "b"
    r = CliRunner().invoke(main, ["bundle", str(src), str(out), "--onnx", "model", "--no-fp32", "--int4"])
    assert r.exit_code == 0, r.output
    r = CliRunner().invoke(main, ["bundle", str(out), "--show"])
    assert r.exit_code == 0 and "bundle OK" in r.output and "tiny-llama.model.int4" in r.output
    (out / "tiny-llama.model.int4.onnx").write_bytes(b"garbage")
    r = CliRunner().invoke(main, ["bundle", str(out), "--show"])
    assert r.exit_code == 1 and "truncated or was replaced" in r.output
    r = CliRunner().invoke(main, ["onnx", str(tmp_path / "nowhere"), str(tmp_path / "x")])
    assert r.exit_code == 1 and "Error:" in r.output and "Traceback" not in r.output


def test_qsun_decoder_served_from_a_q4_0_gguf(exports, tmp_path):
    """QSUN on llama.cpp: the int4 decoder bundled as a Q4_0 GGUF admits a specialist's KV blob.

    Its weights are the int4 grid the prefill was tuned against (Q4_0 holds it exactly,
    tests/unit/test_quant.py); llama.cpp multiplies them with 8-bit activations, so the
    continuation is compared with the torch int4 decoder by agreement, not equality."""
    pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (pip install .[llama])")
    from edge.sun.decoder import SharedDecoder
    from edge.sun.prefill import PrefillWorker
    from edge.model.sun_modules import save_module, split_generate
    from export.tune import build_decoder, save_decoder
    qdec, qfp = build_decoder(exports.model("llama", 1), "int4")
    save_decoder(tmp_path / "dec", qdec, "int4", qfp)
    pre_m = exports.model("llama", 0)
    save_module(tmp_path / "pre", pre_m, {"kind": "sun-prefill", "decoder_fingerprint": qfp,
                                          "decoder_precision": "int4", "task": "t"})
    out, quiet, tok = tmp_path / "qsun", (lambda *_: None), exports.tokenizer()
    build_bundle(tmp_path / "dec", out, onnx_graphs=(), gguf_types=("Q4_0",), tokenizer=tok, log=quiet)
    build_bundle(tmp_path / "pre", out, onnx_graphs=(), gguf_types=("F32",), tokenizer=tok, log=quiet)
    by = {a["name"]: a for a in validate_bundle(out)["artifacts"]}
    assert by["dec.q4_0"]["roles"] == ["decoder"] and by["pre.f32"]["roles"] == ["prefill"]
    assert by["dec.q4_0"]["kv_fingerprint"] == by["pre.f32"]["kv_fingerprint"] == qfp
    worker = PrefillWorker.from_dir(out, task="t", backend="llamacpp", kv_dtype="float32")
    decoder = SharedDecoder.from_dir(out, backend="llamacpp", max_batch=4)
    rng = np.random.default_rng(3)
    ps = [rng.integers(3, 300, size=int(rng.integers(3, 12))).tolist() for _ in range(8)]
    for i, p in enumerate(ps):
        decoder.admit(worker.prefill(p, request_id=f"r{i}").blob, max_new=8)
    # the context holds max_batch sequences: the other four wait, validated, and join as slots free
    assert decoder.load == 8 and decoder.stats_snapshot()["waiting"] == 4
    got = decoder.run()
    want = split_generate(pre_m, qdec, ps, 8)
    assert all(got[f"r{i}"].tokens[0] == w[0] for i, w in enumerate(want))   # the F32 prefill's token
    same = [sum(a == b for a, b in zip(got[f"r{i}"].tokens, w)) / len(w) for i, w in enumerate(want)]
    assert np.mean(same) >= 0.9, same          # measured: 1.0 (8 prompts x 8 tokens)
    assert decoder.engine.active_sequences == 0 and decoder.stats_snapshot()["waiting"] == 0
