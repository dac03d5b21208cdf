"""--parallel on llama.cpp (the real Qwen2.5-Coder-0.5B): two requests at once both complete, well formed,
and rounds of the shared engine served both in one batched llama_decode. Batched and single calls
round differently on llama.cpp, so those texts are not compared with the ones served alone; with exact
rows (edge/engines/llamacpp_rows.py) they are, and are equal."""
from __future__ import annotations


import pytest

from edge.model.fetch import model_path
from harness.at_once import all_at_once

QWEN = model_path("qwen2.5-coder-0.5b")


def _serve(exact_rows: bool = False):
    pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed: `make llama`")
    if not QWEN.exists():
        pytest.skip(f"{QWEN} is missing; run `make test-models`")
    from edge.api.openai_http import OpenAIServer
    from edge.engines.batched_calls import BatchedCalls
    from edge.engines.llamacpp_engine import LlamaCppEngine
    from edge.model.tokenizer import Tokenizer
    from edge.speculative.generate import generate_plain
    inner = LlamaCppEngine(QWEN, max_len=512, n_seq_max=2, threads=2, exact_rows=exact_rows)
    eng, decodes = BatchedCalls(inner), []
    real = inner._decode
    inner._decode = lambda entries, want: decodes.append(len({e[2] for e in entries})) or real(entries, want)

    def generate(prompt_ids, max_new, params, stop_ids=(), on_token=None, on_logits=None, **kw):
        return generate_plain(eng, prompt_ids, max_new, params, stop_ids, on_token, on_logits)
    server = OpenAIServer(generate, Tokenizer.from_gguf(QWEN), "qwen", port=0, parallel=2).start()
    return server, eng, decodes


@pytest.fixture(scope="module")
def served():
    server, eng, decodes = _serve()
    yield server, eng, decodes
    server.stop()
    eng.inner.close()


BODIES = [{"messages": [{"role": "user", "content": q}], "max_tokens": 24, "temperature": 0}
          for q in ("Write a Python function that adds two numbers.", "What is a linked list?")]


def test_two_requests_at_once_complete_and_share_a_decode(served):
    from harness.http_endpoints import post
    server, eng, decodes = served
    out = all_at_once([lambda b=b: post(server, "/v1/chat/completions", b) for b in BODIES], timeout=120)
    for o in out:
        c = o["choices"][0]
        assert c["finish_reason"] in ("stop", "length") and c["message"]["content"].strip()
        assert 0 < o["usage"]["completion_tokens"] <= 24
    assert eng.stats["largest"] == 2 and max(decodes) == 2          # one llama_decode over both sequences
    assert eng.inner.active_sequences == 0


def test_with_exact_rows_two_requests_at_once_answer_as_each_alone():
    """Two threads, a system prompt past 256 tokens (where a lone row's attention is split between the
    threads), each request's rows batched with the other's: the texts equal those served alone."""
    from harness.http_endpoints import post
    system = {"role": "system", "content": " ".join(f"Rule {i}: answer briefly and precisely." for i in range(40))}
    bodies = [{**b, "messages": [system] + b["messages"]} for b in BODIES]
    server, eng, decodes = _serve(exact_rows=True)
    try:
        alone = [post(server, "/v1/chat/completions", b)["choices"][0]["message"]["content"] for b in bodies]
        decodes.clear()
        out = all_at_once([lambda b=b: post(server, "/v1/chat/completions", b) for b in bodies], timeout=120)
        assert [o["choices"][0]["message"]["content"] for o in out] == alone
        assert max(decodes) == 2                                     # batched, not one after the other
    finally:
        server.stop()
        eng.inner.close()
