"""Device roles on llama.cpp and onnxruntime never import torch (it costs ~0.2 GB of RSS alone).

Each check runs in a fresh interpreter: opening the engine the way `edge-agent run` does
(the memory plan's check first, then open_model with the engine arguments it returns), a
prefill, a verify call, and a KV blob out and back in. 'torch' must stay out of sys.modules.
"""
import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

SCRIPT = r"""
import json, sys
from edge.engines.loader import load_engine, open_model
from edge.cli.plan_command import check_before_load
from edge.model.resolved import resolve
ref, backend = sys.argv[1], sys.argv[2]
model = resolve(ref, backend, "target")          # the command's door: resolved once
kw = check_before_load("target", model, 256, None, "64G")
if ref.endswith(".onnx"):             # a bare graph carries no tokenizer: the engine alone
    engine = load_engine(model, max_len=256, **kw)
else:
    engine, tok = open_model(model, max_len=256, **kw)
s = engine.new_sequence()
engine.forward_last(s, [5, 6, 7, 8])
engine.forward(s, [9, 10])
blob = engine.export_kv(s)
engine.check_kv(blob)
engine.free(s)
s2 = engine.import_kv(blob)
print("RESULT " + json.dumps({"torch": "torch" in sys.modules, "kw": kw, "length": engine.length(s2),
                              "capacity": getattr(engine, "capacity", None), "mmap": getattr(engine, "mmap", None)}))
"""


def _run(spec, backend) -> dict:
    r = subprocess.run([sys.executable, "-c", SCRIPT, str(spec), backend], capture_output=True, text=True,
                       cwd=REPO, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    line = next(x for x in r.stdout.splitlines() if x.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])


def test_llamacpp_target_does_not_import_torch(exports):
    pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed: `make llama`")
    got = _run(exports.gguf("qwen2", "F32"), "llamacpp")
    assert got["torch"] is False
    assert got["kw"] == {"n_seq_max": 1} and got["capacity"] == 1     # a target holds one sequence
    assert got["mmap"] is False        # repacked weights on the CPU: read, not mapped (no second copy)
    assert got["length"] == 6                                         # the KV blob came back whole


def test_onnx_engine_does_not_import_torch(exports):
    pytest.importorskip("onnxruntime")
    got = _run(exports.onnx("llama"), "onnx")
    assert got["torch"] is False and got["kw"] == {}
    assert got["length"] == 6


def test_real_llamacpp_target_does_not_import_torch():
    pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed: `make llama`")
    from edge.model.fetch import model_path
    p = model_path("smollm2-135m")
    if not p.exists():
        pytest.skip("SmolLM2-135M is not fetched: `make models`")
    got = _run(p, "llamacpp")
    assert got["torch"] is False and got["capacity"] == 1


SUN_SCRIPT = r"""
import json, sys
import edge.cli.agent_run, edge.wire.link, edge.sun.decoder_node, edge.sun.prefill_node   # what `edge-agent run` loads
from edge.sun.decoder import SharedDecoder
from edge.sun.prefill import PrefillWorker
bundle = sys.argv[1]
worker = PrefillWorker.from_dir(bundle, task="t", backend="llamacpp", kv_dtype="float32")
decoder = SharedDecoder.from_dir(bundle, backend="llamacpp", max_batch=2)
decoder.admit(worker.prefill([5, 6, 7, 8], request_id="r0").blob, max_new=4)
got = decoder.run()
print("RESULT " + json.dumps({"torch": "torch" in sys.modules, "tokens": len(got["r0"].tokens)}))
"""


def test_sun_roles_on_llamacpp_do_not_import_torch(exports, tmp_path):
    """A QSUN prefill worker and shared decoder from a GGUF bundle: no torch in the process."""
    pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed: `make llama`")
    from edge.model.sun_modules import save_module
    from export.bundle import build_bundle
    from export.tune import build_decoder, save_decoder
    qdec, qfp = build_decoder(exports.model("llama", 1), "int4")
    save_decoder(tmp_path / "dec", qdec, "int4", qfp)
    save_module(tmp_path / "pre", exports.model("llama", 0), {"kind": "sun-prefill", "decoder_fingerprint": qfp,
                                                             "decoder_precision": "int4", "task": "t"})
    out, quiet, tok = tmp_path / "qsun", (lambda *_: None), exports.tokenizer()
    build_bundle(tmp_path / "dec", out, onnx_graphs=(), gguf_types=("Q4_0",), tokenizer=tok, log=quiet)
    build_bundle(tmp_path / "pre", out, onnx_graphs=(), gguf_types=("F32",), tokenizer=tok, log=quiet)
    r = subprocess.run([sys.executable, "-c", SUN_SCRIPT, str(out)], capture_output=True, text=True, cwd=REPO,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    got = json.loads(next(x for x in r.stdout.splitlines() if x.startswith("RESULT "))[len("RESULT "):])
    assert got["torch"] is False
    assert got["tokens"] == 4
