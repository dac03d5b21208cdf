#!/usr/bin/env bash
# Build llama-cpp-python from source for THIS CPU and install it into a venv.
#
# Why not `pip install llama-cpp-python`: it builds with -march=native, and on CPUs with AMX
# (Sapphire Rapids and later Xeons) ggml then compiles its AMX backend, repacks quantised
# weights into an AMX buffer and the first matmul segfaults (upstream llama.cpp issue 20824).
# We build with AMX off. pip's wheel cache is bypassed (--no-cache-dir): a wheel built on
# another CPU must never be reused; our own cache is keyed by the version, the build flags,
# the compiler and this CPU's feature flags.
#
# usage: scripts/llama_wheel.sh VENV_BIN   (env: LLAMA_VERSION, LLAMA_CMAKE_ARGS, STARSUN_WHEEL_CACHE=off)
set -euo pipefail
BIN=${1:?usage: llama_wheel.sh VENV_BIN}
VERSION=${LLAMA_VERSION:-0.3.36}
CMAKE_ARGS=${LLAMA_CMAKE_ARGS:--DLLAVA_BUILD=OFF}
NO_AMX="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
export CMAKE_ARGS CFLAGS="${CFLAGS:-} $NO_AMX" CXXFLAGS="${CXXFLAGS:-} $NO_AMX"

cpu_flags=$(grep -m1 '^flags' /proc/cpuinfo 2>/dev/null | tr ' ' '\n' | sort | tr '\n' ' ' || uname -m)
key=$(printf '%s\n' "$VERSION" "$CMAKE_ARGS" "$CFLAGS" "$CXXFLAGS" "$(${CC:-cc} --version 2>/dev/null | head -1)" \
      "$("$BIN/python" -c 'import sys; print(sys.version)')" "$cpu_flags" | sha256sum | cut -c1-16)
cache=${STARSUN_WHEEL_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/starsun/wheels}
dir="$cache/llama-cpp-python-$VERSION-$key"

wheel=$(ls "$dir"/*.whl 2>/dev/null | head -1 || true)
if [ "${STARSUN_WHEEL_CACHE:-}" = off ] || [ -z "$wheel" ]; then
  echo "building llama-cpp-python $VERSION from source for this CPU (minutes; CMAKE_ARGS=$CMAKE_ARGS, AMX off)"
  tmp=$(mktemp -d)
  "$BIN/pip" wheel -q --no-cache-dir --no-deps --no-binary llama-cpp-python -w "$tmp" "llama-cpp-python==$VERSION"
  wheel=$(ls "$tmp"/*.whl | head -1)
  if [ "${STARSUN_WHEEL_CACHE:-}" != off ]; then
    mkdir -p "$dir" && mv "$wheel" "$dir/" && wheel="$dir/$(basename "$wheel")"
  fi
else
  echo "llama-cpp-python $VERSION: reusing the wheel built for this CPU and these flags ($dir)"
fi
"$BIN/pip" install -q --no-cache-dir --force-reinstall --no-deps "$wheel"
"$BIN/pip" install -q "numpy>=1.20" "typing-extensions>=4.5" "diskcache>=5.6.1" "jinja2>=2.11.3"
# what the build uses, for the log (AMX_INT8 must not be 1)
"$BIN/python" -c 'import llama_cpp; print("llama.cpp CPU features:", llama_cpp.llama_print_system_info().decode())'
