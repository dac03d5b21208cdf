#!/usr/bin/env bash
# Build llama.cpp's own command-line tools (llama-speculative-simple, llama-speculative, llama-lookup,
# llama-server, llama-bench, llama-completion) from the source vendored in the llama-cpp-python
# release the kit uses, so its native speculation is measured against the same ggml on the same CPU
# (benchmarks/speculative/native_spec.py). Same flags as scripts/llama_wheel.sh: -march=native, AMX off.
#
# usage: scripts/llama_tools.sh VENV_BIN   -> prints the bin directory (env: LLAMA_VERSION, STARSUN_TOOLS_DIR)
set -euo pipefail
BIN=${1:?usage: llama_tools.sh VENV_BIN}
VERSION=${LLAMA_VERSION:-0.3.36}
NO_AMX="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
TOOLS="llama-speculative-simple llama-speculative llama-lookup llama-server llama-bench llama-completion"
cpu_flags=$(grep -m1 '^flags' /proc/cpuinfo 2>/dev/null | tr ' ' '\n' | sort | tr '\n' ' ' || uname -m)
key=$(printf '%s\n' "$VERSION" "$NO_AMX" "$(${CC:-cc} --version 2>/dev/null | head -1)" "$cpu_flags" \
      | sha256sum | cut -c1-16)
out=${STARSUN_TOOLS_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/starsun/llama-tools-$VERSION-$key}
if [ -x "$out/bin/llama-speculative-simple" ]; then
  echo "$out/bin"; exit 0
fi
command -v cmake >/dev/null || { echo "cmake is missing: apt-get install -y cmake" >&2; exit 1; }
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
echo "building llama.cpp tools from llama-cpp-python $VERSION's vendored source (minutes)" >&2
"$BIN/pip" download -q --no-cache-dir --no-deps --no-binary :all: -d "$tmp" "llama-cpp-python==$VERSION" >&2
tar xzf "$tmp"/llama_cpp_python-*.tar.gz -C "$tmp"
src=$(ls -d "$tmp"/llama_cpp_python-*/vendor/llama.cpp)
CFLAGS="$NO_AMX" CXXFLAGS="$NO_AMX" cmake -S "$src" -B "$tmp/build" -DCMAKE_BUILD_TYPE=Release \
  -DGGML_NATIVE=ON -DLLAMA_BUILD_TESTS=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_UI=OFF \
  -DLLAMA_USE_PREBUILT_UI=OFF -DBUILD_SHARED_LIBS=OFF >&2
# shellcheck disable=SC2086
cmake --build "$tmp/build" -j "$(nproc)" --target $TOOLS >&2
mkdir -p "$out/bin"
for t in $TOOLS; do cp "$tmp/build/bin/$t" "$out/bin/"; done
"$out/bin/llama-bench" --help >/dev/null 2>&1 || true
echo "$out/bin"
