"""A model's GGUF in another storage format: the same weights, a different cost regime.

On one AVX-512 core, Qwen2.5-Coder-1.5B Q4_K_M decodes compute-bound: a call over 4 tokens
costs ~3.7 one-token steps, so no draft can pay there. Stored as F16 (or Q8_0) the same weights
decode memory-bound: 4 tokens for ~1.5 steps, the regime of a Jetson's GPU, where speculation
is meant to pay. The Q4_K_M file alone is still the faster one on such a CPU, which is why the
demo and the benchmarks print its tok/s next to each speedup. For a draft service on an x86 hub
Q4_0 is the cheaper file: llama.cpp repacks it for its AVX kernels (benchmarks/star/draft_formats.py).

`target_gguf(name, "F16")` writes models/<stem>-f16.gguf once (llama.cpp's quantiser, ~20 s,
dequantising each Q4_K tensor) and reuses it. Here (export/) so that both server/ (the demo)
and benchmarks/ may import it.
"""
from __future__ import annotations

import sys
import threading
import time
from pathlib import Path
from typing import Union

NATIVE = "native"
FORMATS = (NATIVE, "F16", "BF16", "Q8_0", "Q4_0")


def wide_format(cpuinfo: str = "/proc/cpuinfo") -> str:
    """BF16 where the CPU has a native BF16 dot product (x86 avx512_bf16, Arm bf16), else F16.

    On Zen 4 (one core, Qwen2.5-Coder-1.5B) BF16 decodes ~10% faster than F16 and a verify over
    2 / 4 / 8 tokens costs 1.42 / 1.62 / 2.14 steps against F16's 1.58 / 1.72 / 3.1 (llama-bench);
    without the instruction BF16 is converted in software, so F16 is the safe choice."""
    from edge.telemetry.cpu_info import cpu_flags
    flags = cpu_flags(cpuinfo)
    return "BF16" if "avx512_bf16" in flags or "bf16" in flags else "F16"


def converted_path(src: Path, fmt: str) -> Path:
    """models/<stem>-<fmt>.gguf next to `src`, its quantisation suffix (-q4_k_m) dropped."""
    stem = src.stem.rsplit("-q", 1)[0] if "-q" in src.stem else src.stem
    return src.with_name(f"{stem}-{fmt.lower()}.gguf")


def target_gguf(name: Union[str, Path], fmt: str = NATIVE) -> Path:
    """The path of model `name`'s GGUF (a model name or a GGUF path) stored as `fmt` (native: as fetched)."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown target format {fmt!r}; choose one of {', '.join(FORMATS)}")
    from edge.model.reference import resolve_model
    src = resolve_model(name)
    if fmt == NATIVE:
        return src
    if src.suffix != ".gguf":
        raise ValueError(f"storing a target as {fmt} needs a GGUF file (llama.cpp's quantiser); {src} is not one")
    out = converted_path(src, fmt)
    if not out.is_file():
        from export.gguf import quantize_with_llamacpp
        _quiet_llamacpp()
        tmp = out.with_suffix(".tmp")
        with _progress(tmp, f"writing {out.name} ({fmt}, once) from {src.name} with llama.cpp's quantiser"):
            quantize_with_llamacpp(src, tmp, fmt, requantize=True)
        tmp.rename(out)                   # a killed run leaves no half-written model behind
    return out


def _quiet_llamacpp() -> None:
    """llama.cpp logs a line per tensor while quantising (~340 here): errors only, our bar instead."""
    try:
        from llama_cpp._logger import set_verbose   # as edge/engines/llamacpp_engine.py does
    except ImportError:                             # no llama.cpp: quantize_with_llamacpp says so
        return
    set_verbose(False)


class _progress:
    """A tqdm line of the bytes written so far: the quantiser is one C call (~20 s) with no callback,
    so a thread watches the file grow."""

    def __init__(self, path: Path, desc: str):
        self.path, self.desc, self.done = path, desc, threading.Event()

    def _watch(self, bar) -> None:
        while not self.done.wait(0.5):
            size = self.path.stat().st_size if self.path.exists() else 0
            bar.update(size - bar.n)

    def __enter__(self):
        from tqdm import tqdm
        print(self.desc + " ...", file=sys.stderr, flush=True)
        self.t0 = time.monotonic()
        self.bar = tqdm(unit="B", unit_scale=True, desc="  written", file=sys.stderr, leave=False)
        self.thread = threading.Thread(target=self._watch, args=(self.bar,), daemon=True)
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.done.set()
        self.thread.join()
        self.bar.close()
        if exc[0] is None:
            size = self.path.stat().st_size / 1e9 if self.path.exists() else 0.0
            print(f"  done: {size:.1f} GB in {time.monotonic() - self.t0:.0f} s", file=sys.stderr, flush=True)
