"""The target's GGUF in another storage format: the same weights, a different cost regime.

On one AVX-512 core, Qwen2.5-Coder-1.5B Q4_K_M decodes compute-bound: a call over 4 tokens
costs ~3.7 one-token steps, so no draft can pay there. Stored as F16 (or Q8_0) the same weights
decode memory-bound: 4 tokens for ~1.5 steps, the regime of a Jetson's GPU, where speculation
is meant to pay. The benchmarks measure both and report absolute tok/s next to each speedup,
because the Q4_K_M target alone is faster than the F16 one.

`target_gguf(name, "F16")` writes models/<stem>-f16.gguf once (llama.cpp's quantiser, ~20 s,
dequantising each Q4_K tensor) and reuses it.
"""
from __future__ import annotations

from pathlib import Path

NATIVE = "native"
FORMATS = (NATIVE, "F16", "Q8_0")


def target_gguf(name: str, fmt: str = NATIVE) -> Path:
    """The path of model `name`'s GGUF stored as `fmt` (native: as fetched)."""
    from edge.fetch import model_path
    src = model_path(name)
    if fmt == NATIVE:
        return src
    if fmt not in FORMATS:
        raise ValueError(f"unknown target format {fmt!r}; choose one of {', '.join(FORMATS)}")
    stem = src.stem.rsplit("-q", 1)[0] if "-q" in src.stem else src.stem
    out = src.with_name(f"{stem}-{fmt.lower()}.gguf")
    if not out.is_file():
        from export.gguf import quantize_with_llamacpp
        print(f"writing {out.name} ({fmt}) from {src.name} with llama.cpp's quantiser ...", flush=True)
        tmp = out.with_suffix(".tmp")
        quantize_with_llamacpp(src, tmp, fmt, requantize=True)
        tmp.rename(out)                   # a killed run leaves no half-written model behind
    return out
