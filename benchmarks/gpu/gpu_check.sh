#!/usr/bin/env bash
# One prepared GPU check (issue 35): run it once on an NVIDIA machine, from anywhere.
#   bash benchmarks/gpu/gpu_check.sh [--dtypes bfloat16,float16] [--llama-sdist FILE] [...]
# Writes $OUT/gpu_check.{json,md} ($OUT: the environment's, else a temp dir). Needs only this
# repository and a python3 with torch (CUDA); no registry. It stops starting new parts after
# --budget-s (420 s) and is killed at GPU_CHECK_TIMEOUT (480 s), keeping what it wrote.
# The dry run on a CPU: bash benchmarks/gpu/gpu_check.sh --accelerator cpu --quick
set -euo pipefail
cd "$(dirname "$0")/../.."
if [ -z "${PY:-}" ]; then
    if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi
OUT=${OUT:-$(mktemp -d -t gpu-check-XXXXXX)}
export OUT PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || echo "(no nvidia-smi)"
command -v nvcc >/dev/null && nvcc --version | tail -1 || echo "(no nvcc: the GGUF part needs a CUDA llama-cpp-python)"
exec timeout "${GPU_CHECK_TIMEOUT:-480}" "$PY" -m benchmarks.gpu.gpu_check --out "$OUT" "$@"
