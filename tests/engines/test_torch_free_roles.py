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
from edge.plan_command import check_before_load
spec, backend = sys.argv[1], sys.argv[2]
kw = check_before_load("target", spec, backend, 256, None, "64G")
if spec.endswith(".onnx"):            # a bare graph carries no tokenizer: the engine alone
    engine = load_engine(spec, backend=backend, role="target", max_len=256, **kw)
else:
    engine, tok = open_model(spec, backend=backend, role="target", max_len=256, **kw)
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
    from edge.fetch import model_path
    p = model_path("smollm2-135m")
    if not p.exists():
        pytest.skip("SmolLM2-135M is not fetched: `make models`")
    got = _run(p, "llamacpp")
    assert got["torch"] is False and got["capacity"] == 1
