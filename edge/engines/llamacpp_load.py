"""Opening a GGUF with llama-cpp-python for LlamaCppEngine (edge/engines/llamacpp_engine.py): the
library and its backend, the model (weight buffers, mmap or read) and a context of sequences."""
from __future__ import annotations

import logging
from typing import Optional, Tuple

from edge.engines.base import EngineError
from edge.engines.cpu_threads import default_threads
from edge.engines.llamacpp_repack import RepackChoice, amx_compiled, auto_repacks, choose_repack

__all__ = ["amx_compiled", "auto_repacks"]   # where tests and benchmarks read them

log = logging.getLogger(__name__)
_BACKEND_READY = False
KV_TYPES = {"f32": 0, "f16": 1}   # ggml types
KV_ITEMSIZE = {"f32": 4, "f16": 2}


def llama_lib():
    try:
        import llama_cpp
    except ImportError:
        raise EngineError("the llamacpp backend needs llama-cpp-python: "
                          "pip install 'llama-cpp-python==0.3.36' (or `pip install .[llama]`)") from None
    return llama_cpp


def init_backend(llama_cpp, verbose: bool) -> None:
    global _BACKEND_READY
    if not _BACKEND_READY:
        llama_cpp.llama_backend_init()
        _BACKEND_READY = True
    from llama_cpp._logger import set_verbose  # its log callback prints only at this level or above
    set_verbose(verbose)


def load_model(lc, path: str, n_gpu_layers: int, extra_bufts: Optional[bool],
               mmap: Optional[bool]) -> Tuple[object, bool, object, RepackChoice]:
    """(the llama model of the GGUF at `path`, whether it is mapped, the llama_model_params it was
    loaded with: its n_gpu_layers is what llama.cpp was told, the weight repacking chosen and why);
    extra_bufts and mmap as LlamaCppEngine's (None: chosen here, llamacpp_repack.py)."""
    mp = lc.llama_model_default_params()
    mp.n_gpu_layers = int(n_gpu_layers)
    repack = choose_repack(extra_bufts, amx_compiled(lc), path)
    if repack.amx_guard:
        log.warning("%s: %s", path, repack.describe())
    else:
        log.info("%s: %s", path, repack.describe())
    if repack.extra_bufts is not None:
        mp.use_extra_bufts = bool(repack.extra_bufts)
    # repacked weights are a copy: mapping the file too would keep both resident (~0.6 GB more RSS for the
    # 1.5B Q4_K_M with a 4,096-token context: 1,862 MiB peak mapped, 1,272 MiB read)
    if mmap is None:
        mmap = not (repack.on and int(n_gpu_layers) == 0)
    if hasattr(mp, "load_mode"):     # llama.cpp >= 0.3.3x: llama_load_mode replaces use_mmap
        mp.load_mode = lc.LLAMA_LOAD_MODE_MMAP if mmap else lc.LLAMA_LOAD_MODE_NONE
    else:
        mp.use_mmap = bool(mmap)
    model = lc.llama_model_load_from_file(path.encode(), mp)
    if not model:
        raise EngineError(f"llama.cpp could not load {path} (not a GGUF it supports, or truncated)")
    return model, bool(mmap), mp, repack


def layers_on_gpu(lc, n_gpu_layers: int, n_layer: int) -> int:
    """How many of the model's layers llama.cpp offloads for n_gpu_layers (< 0: all): none on a
    build without a GPU backend, which runs everything on the CPU whatever it is told."""
    if not lc.llama_supports_gpu_offload():
        return 0
    return n_layer if n_gpu_layers < 0 else min(int(n_gpu_layers), n_layer)


def new_context(lc, model, path: str, max_len: int, n_seq_max: int, n_batch: int, kv_type: str,
                flash_attn: Optional[bool], threads: Optional[int]):
    """A llama context of `model` holding n_seq_max sequences of max_len tokens each; threads: None = one
    per physical core this process may run on (edge/engines/cpu_threads.py), as llama-server does, not
    the library's 4 (two a core on a 2-core machine)."""
    cp = lc.llama_context_default_params()
    cp.n_seq_max = int(n_seq_max)
    cp.n_ctx = int(max_len) * int(n_seq_max)
    cp.n_batch = cp.n_ubatch = int(n_batch)
    cp.kv_unified = False  # each sequence gets its own max_len slots
    cp.no_perf = True
    if kv_type not in KV_TYPES:
        raise EngineError(f"kv_type must be one of {sorted(KV_TYPES)}, got {kv_type!r}")
    cp.type_k = cp.type_v = KV_TYPES[kv_type]
    if flash_attn is not None:
        cp.flash_attn_type = int(bool(flash_attn))   # LLAMA_FLASH_ATTN_TYPE_DISABLED / _ENABLED
    cp.n_threads = cp.n_threads_batch = int(threads or default_threads())
    ctx = lc.llama_init_from_model(model, cp)
    if not ctx:
        raise EngineError(f"llama.cpp could not create a context of {cp.n_ctx} tokens for {path}")
    return ctx
