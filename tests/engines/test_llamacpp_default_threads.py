"""A llama.cpp context opened without `threads` computes with one thread per physical core it may
run on (edge/engines/cpu_threads.py), as llama-server does, not the library's default of 4."""
from __future__ import annotations

import pytest


def test_llamacpp_context_without_threads_takes_the_default(monkeypatch):
    pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed: `make llama`")
    from edge.model.fetch import model_path
    path = model_path("smollm2-135m")
    if not path.exists():
        pytest.skip(f"{path} is missing; run `make test-models`")
    import llama_cpp

    from edge.engines import llamacpp_load
    from edge.engines.llamacpp_engine import LlamaCppEngine
    monkeypatch.setattr(llamacpp_load, "default_threads", lambda: 3)
    for threads, want in ((None, 3), (1, 1)):
        eng = LlamaCppEngine(path, max_len=64, n_seq_max=1, threads=threads)
        try:
            assert llama_cpp.llama_n_threads(eng._ctx) == want
            assert llama_cpp.llama_n_threads_batch(eng._ctx) == want
        finally:
            eng.close()
