"""The prepared GPU check (benchmarks/gpu/gpu_check.sh) dry-runs on the CPU with every section,
needs nothing the GPU machine lacks, and builds the real models' shapes."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
HANG_GUARD_S = 1800


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("gpu-check")
    # every section must run, however loaded the machine: a time budget the dry run never spends
    # (--quick's own is 90 s: on a loaded machine it skipped the GGUF path), and the timeouts only
    # as hang guards
    r = subprocess.run(["bash", "benchmarks/gpu/gpu_check.sh", "--accelerator", "cpu", "--quick",
                        "--dtypes", "float32,bfloat16", "--budget-s", str(HANG_GUARD_S)], cwd=REPO,
                       capture_output=True, text=True, timeout=HANG_GUARD_S + 60,
                       env={**os.environ, "OUT": str(out), "PY": sys.executable,
                            "GPU_CHECK_TIMEOUT": str(HANG_GUARD_S + 30)})
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    return {"json": json.loads((out / "gpu_check.json").read_text()), "md": (out / "gpu_check.md").read_text()}


def test_the_dry_run_writes_every_section(dry_run):
    res = dry_run["json"]
    assert res["args"]["device"] == "cpu" and res["args"]["quick"] is True and res["skipped"] == []
    assert set(res["models"]) == {f"{m}/{d}" for m in ("tiny-llama", "tiny-qwen2") for d in ("float32", "bfloat16")}
    for r in res["models"].values():
        assert set(r["step_ms"]) == {"1", "4", "16"} and all(v > 0 for v in r["step_ms"].values())
        assert set(r["verify_cost"]) == {str(k) for k in range(1, 9)} and r["verify_cost"]["1"] == 1.0
        assert r["prefill_tok_s"] > 0 and r["params"] > 0
    assert set(res["draft_service"]) == {"tiny-llama/float32", "tiny-llama/bfloat16"}
    assert all(set(s["service_ms"]) == {"1", "4", "16"} for s in res["draft_service"].values())
    fp32 = res["lossless"]["float32"]
    assert fp32["passed"] and fp32["identical"] == fp32["prompts"] and 0.1 < fp32["acceptance"] < 0.95
    assert res["lossless"]["bfloat16"]["verdict"] != "DIFFERS beyond rounding"
    for dtype in ("float32", "bfloat16"):
        chi2 = res["lossless"][dtype]["chi2"]
        assert chi2["passed"] and chi2["df"] >= 30 and chi2["n"] == 1500
    plans = res["planner"]["plans"]
    assert {(p["draft_dtype"], p["target_name"]) for p in plans} == {
        (d, t) for d in ("float32", "bfloat16") for t in ("jetson-orin-nano-8gb", "jetson-agx-orin-32gb", "this device")}
    for p in plans:
        assert p["n_full"] in res["args"]["ns"] and p["speedup_n1"] > 0 and p["target_step_ms"] > 0
    gguf = res["gguf"]
    assert "skipped" in gguf or set(gguf["models"]) == {"tiny-llama/F16", "tiny-qwen2/F16"}
    for heading in ("## Step, verify, prefill", "## The draft service's D(b)", "## Losslessness", "## StarSD planner",
                    "## GGUF path"):
        assert heading in dry_run["md"]


def test_it_needs_nothing_the_gpu_machine_lacks(tmp_path):
    """The GPU image has torch, numpy, msgpack, tokenizers but neither paho-mqtt nor gguf."""
    code = ("import sys; sys.modules['paho'] = None; sys.modules['gguf'] = None\n"
            "from benchmarks.gpu.gpu_check import main\n"
            f"main(['--accelerator', 'cpu', '--quick', '--dtypes', 'float32', '--out', {str(tmp_path)!r}])\n"
            "assert 'paho' not in [m.split('.')[0] for m in sys.modules if sys.modules[m] is not None]")
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=HANG_GUARD_S)
    assert r.returncode == 0, r.stderr[-2000:]
    res = json.loads((tmp_path / "gpu_check.json").read_text())
    assert res["planner"]["plans"] and "skipped" in res["gguf"]         # no gguf there: said, not failed


def test_cuda_without_a_gpu_says_how_to_dry_run():
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    from benchmarks.gpu.gpu_check import main
    with pytest.raises(SystemExit, match="--accelerator cpu --quick"):
        main(["--accelerator", "cuda"])


def test_the_shapes_are_the_real_models():
    """SHAPES against the fetched GGUFs' own metadata (where `make models` fetched them)."""
    from benchmarks.gpu._measure import SHAPES
    from edge.model.checkpoint import _gguf_config
    from edge.model.checkpoint_files import open_gguf_checked
    from edge.model.fetch import model_path
    fetched = {n: model_path(n) for n in SHAPES if model_path(n).exists()}
    if not fetched:
        pytest.skip("no model is fetched: `make models`")
    for name, path in fetched.items():
        real, ours = _gguf_config(open_gguf_checked(path)), SHAPES[name]
        for field in ("arch", "vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                      "num_kv_heads", "head_dim", "qkv_bias", "tie_embeddings"):
            assert getattr(ours, field) == getattr(real, field), (name, field)
