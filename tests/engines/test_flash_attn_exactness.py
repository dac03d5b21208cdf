"""The llama.cpp engine's default context keeps greedy speculative text bit-identical to plain
decoding on a real GGUF (SmolLM2-135M Q4_1): llama.cpp's flash attention, on by its `auto` on the
CPU, computes a short ubatch one query row at a time, so a verify of γ+1 rows rounds exactly as
one-row decoding does. Without it (flash_attn=False: faster over a long cache) the verify's
attention is a matmul over the rows and this prompt's text already differs at token 8 -- the
negative control that shows the check can fail."""
import pytest

from edge.speculative.generate import ModelDrafter, generate_plain, generate_speculative
from harness.gguf_star import GGUF, MAX_NEW, PROMPT

pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed: `make llama`")
from edge.engines.llamacpp_engine import LlamaCppEngine  # noqa: E402


def _texts(**kw):
    target = LlamaCppEngine(str(GGUF), threads=1, max_len=512, **kw)
    draft = LlamaCppEngine(str(GGUF), threads=1, max_len=512, **kw)
    plain = generate_plain(target, PROMPT, MAX_NEW).tokens
    return plain, [generate_speculative(target, ModelDrafter(draft), PROMPT, MAX_NEW, gamma=g).tokens for g in (2, 5)]


def test_default_context_speculative_greedy_equals_plain():
    if not GGUF.is_file():
        pytest.skip(f"{GGUF.name} is not fetched: `make test-models`")
    plain, specs = _texts()
    assert all(s == plain for s in specs)


def test_without_flash_attention_the_rows_round_differently():
    if not GGUF.is_file():
        pytest.skip(f"{GGUF.name} is not fetched: `make test-models`")
    plain, specs = _texts(flash_attn=False)
    assert any(s != plain for s in specs)
