"""The optional GGUF (llama.cpp) part of benchmarks.gpu.gpu_check.

On CUDA it needs a llama-cpp-python that can offload: one already importable with GPU offload,
or one built here from a carried sdist (`--llama-sdist`) when nvcc and CMake are present (the
GPU machine reaches no registry: scikit-build-core must be installed, the build runs
--no-build-isolation). Anything missing skips the section with a message saying what; it never
fails the check. On the CPU (the dry run) it times the installed llama.cpp with no GPU layers.
"""
from __future__ import annotations

import os
import shutil
import site
import subprocess
import sys
import types
from pathlib import Path
from typing import Optional, Tuple

REPO = Path(__file__).resolve().parents[2]
SDIST_GLOBS = ("llama_cpp_python-*.tar.gz", "llama-cpp-python-*.tar.gz")


def find_sdist(given: Optional[str]) -> Optional[Path]:
    """--llama-sdist, else one carried in .whl/ or benchmarks/gpu/."""
    if given:
        return Path(given)
    for folder in (REPO / ".whl", Path(__file__).parent):
        for pattern in SDIST_GLOBS:
            hits = sorted(folder.glob(pattern))
            if hits:
                return hits[-1]
    return None


def _nvcc() -> Optional[str]:
    return shutil.which("nvcc") or next((p for p in ("/usr/local/cuda/bin/nvcc",) if os.path.exists(p)), None)


def build_cuda_llama(sdist: Path, work: Path, timeout_s: float) -> Tuple[bool, str]:
    """pip wheel the sdist with CUDA for this machine's GPU, install it under work/site."""
    env = {**os.environ, "CMAKE_ARGS": "-DGGML_CUDA=on -DCMAKE_CUDA_ARCHITECTURES=native -DLLAVA_BUILD=OFF",
           "CMAKE_BUILD_PARALLEL_LEVEL": str(os.cpu_count() or 4)}
    nvcc = _nvcc()
    if nvcc:
        env["CUDACXX"] = nvcc
        env["PATH"] = f"{Path(nvcc).parent}:{env.get('PATH', '')}"
    wheels = work / "wheels"
    try:
        r = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
                            "-w", str(wheels), str(sdist)], env=env, capture_output=True, text=True,
                           timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return False, f"the CUDA build of {sdist.name} ran past {timeout_s:.0f} s"
    if r.returncode != 0:
        return False, f"the CUDA build failed: {(r.stderr or r.stdout)[-1500:]}"
    wheel = next(wheels.glob("llama_cpp_python-*.whl"))
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "--target",
                    str(work / "site"), str(wheel)], check=True, capture_output=True)
    site.addsitedir(str(work / "site"))   # the GPU machine has no llama-cpp-python of its own
    return True, f"built {wheel.name} with CUDA (CMAKE_CUDA_ARCHITECTURES=native)"


def _import_llama():
    """llama_cpp, with a stand-in for diskcache (imported at load, used only by its disk cache,
    which this check never opens) where the machine lacks it."""
    try:
        import diskcache  # noqa: F401
    except ImportError:
        sys.modules["diskcache"] = types.SimpleNamespace(Cache=object)
    import llama_cpp
    return llama_cpp


def llama_runtime(device: str, sdist_arg: Optional[str], work: Path, timeout_s: float) -> Tuple[object, str]:
    """(llama_cpp or None, what happened)."""
    try:
        llama = _import_llama()
        if device == "cpu" or llama.llama_supports_gpu_offload():
            return llama, f"the installed llama-cpp-python {llama.__version__}"
        have = f"the installed llama-cpp-python {llama.__version__} is CPU-only"
    except ImportError:
        have = "no llama-cpp-python is installed"
    if device == "cpu":
        return None, have
    sdist = find_sdist(sdist_arg)
    missing = [what for what, ok in (("nvcc", _nvcc()), ("cmake", shutil.which("cmake")),
                                     ("a llama-cpp-python sdist (--llama-sdist, or one in .whl/)",
                                      sdist and sdist.is_file())) if not ok]
    if missing:
        return None, f"{have}, and no CUDA build is possible here: missing {', '.join(missing)}"
    for name in [m for m in sys.modules if m == "llama_cpp" or m.startswith("llama_cpp.")]:
        del sys.modules[name]          # the CPU-only one, if it was imported above
    ok, msg = build_cuda_llama(sdist, work, timeout_s)
    if not ok:
        return None, f"{have}; {msg}"
    llama = _import_llama()
    if not llama.llama_supports_gpu_offload():
        return None, f"{msg}, but it cannot offload (llama_supports_gpu_offload() is False)"
    return llama, msg


def gguf_section(device: str, shapes: dict, work: Path, sdist: Optional[str], timeout_s: float,
                 context: int, prefill: int, reps: int) -> dict:
    """Step (batch 1), verify k = 1..8 and prefill of F16 GGUFs of the shapes on llama.cpp."""
    llama, how = llama_runtime(device, sdist, work, timeout_s)
    if llama is None:
        return {"skipped": f"skipped: {how}"}
    try:
        import gguf  # noqa: F401  (export.gguf writes with it)
    except ImportError:
        return {"skipped": "skipped: the gguf package is missing (carry its wheel: it is pure Python)"}
    import torch

    from benchmarks.gpu._measure import prefill_tok_s, step_times, verify_times
    from edge.engines.llamacpp_engine import LlamaCppEngine
    from edge.model.transformer import Transformer
    from export.gguf import write_gguf
    from harness.tiny_models import small_bpe
    out = {"runtime": how, "gpu_layers": "all" if device == "cuda" else 0, "models": {}}
    for name, cfg in shapes.items():
        torch.manual_seed(0)
        path = write_gguf(work / f"{name}.gguf", cfg, Transformer(cfg).state_dict(), small_bpe(), ftype="F16")
        eng = LlamaCppEngine(path, max_len=prefill + 256, n_seq_max=1, n_gpu_layers=-1 if device == "cuda" else 0)
        step = step_times(eng, [1], context, reps)[1]
        ver = verify_times(eng, range(1, 9), context, reps)
        out["models"][f"{name}/F16"] = {"step_ms": step, "verify_cost": {k: v / ver[1] for k, v in ver.items()},
                                        "prefill_tok_s": prefill_tok_s(eng, prefill, reps)}
        del eng                        # frees the llama.cpp context before the next model
        path.unlink()
    return out
