"""Every GGUF type the kit ships loads and decodes through llama.cpp: the high-level `Llama`
class and our engine, on real weights.

Why: on CPUs with AMX a `-march=native` llama.cpp repacks quantised weights into an AMX buffer
and the first matmul segfaults (llama.cpp issue 20824) -- a crash only a real decode on each
weight type shows. A segfault here ends the run with pytest's faulthandler traceback: CI fails.
Types: Q4_1 (SmolLM2 as shipped), Q4_K_M (Qwen2.5-Coder-0.5B as shipped), and F16, Q8_0, Q4_0
written by our exporter from SmolLM2 (the SUN / QSUN decoders are served from these).
"""
from __future__ import annotations

import numpy as np
import pytest

from edge.model.fetch import model_path

N_NEW = 6
PROMPT = "def fibonacci(n):"


def _shipped(name):
    path = model_path(name)
    if not path.exists():
        pytest.skip(f"{path} is missing; run `make test-models`")
    return path


@pytest.fixture(scope="module")
def gguf_files(module_tmp_path):
    pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed: `make llama`")
    from export.gguf import export_gguf
    root = module_tmp_path
    smol = _shipped("smollm2-135m")
    files = {"Q4_1": smol, "Q4_K_M": _shipped("qwen2.5-coder-0.5b")}
    for ftype in ("F16", "Q8_0", "Q4_0"):
        files[ftype] = export_gguf(smol, root / f"smollm2-{ftype}.gguf", ftype)
    return files


def _llama_greedy(path, ids):
    import llama_cpp
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=128, n_threads=2, verbose=False)
    try:
        out = []
        for t in llm.generate(ids, temp=0.0, top_k=1, reset=True):
            out.append(int(t))
            if len(out) == N_NEW:
                break
        return out, llm.n_vocab()
    finally:
        llm.close()


@pytest.mark.parametrize("ftype", ["Q4_0", "Q4_1", "Q4_K_M", "Q8_0", "F16"])
def test_each_gguf_type_decodes_in_llama_and_in_our_engine(gguf_files, ftype):
    from edge.engines.llamacpp_engine import LlamaCppEngine
    from edge.speculative.generate import generate_plain
    from edge.model.tokenizer import Tokenizer

    path = gguf_files[ftype]
    ids = Tokenizer.from_gguf(path).encode(PROMPT)
    ref, n_vocab = _llama_greedy(path, ids)
    eng = LlamaCppEngine(path, max_len=128, n_seq_max=1, threads=2)
    seq = eng.new_sequence()
    logits = eng.forward(seq, ids)
    eng.free(seq)
    assert logits.shape == (len(ids), n_vocab) and np.isfinite(logits).all()
    ours = generate_plain(eng, ids, N_NEW).tokens
    assert len(ref) == len(ours) == N_NEW
    # the same greedy step in both (one prefill call, then one-token calls: the same kernels)
    assert ours[0] == ref[0], (ftype, ours, ref)
    assert len(set(ours)) > 1, f"{ftype}: degenerate output {ours}"
