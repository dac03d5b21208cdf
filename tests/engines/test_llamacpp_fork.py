"""Engine.fork on llama.cpp (the real Qwen2.5-Coder-0.5B) and the prompt cache's use of it
(edge/speculative/prefix_cache.py): a request sharing a short prefix (FORK_ENOUGH..SHARED_ENOUGH
tokens) with a held conversation gets a copy of that prefix's KV and the conversation stays held.
The fork's KV is the source's own cells, so its continuation equals the source's bit for bit."""
from __future__ import annotations

import numpy as np
import pytest

from harness.agent_asks import qwen_llamacpp
from edge.speculative.common_prefix import common_prefix
from edge.speculative.generate import generate_plain
from edge.speculative.prefix_cache import FORK_ENOUGH, SHARED_ENOUGH, PrefixCache


@pytest.fixture(scope="module")
def qwen():
    engine, tok = qwen_llamacpp(max_len=512)
    yield engine, tok
    engine.close()


def test_a_fork_continues_exactly_as_its_source(qwen):
    engine, tok = qwen
    text = tok.encode("def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n    a, b = 0, 1\n"
                      "    for _ in range(n):\n        a, b = b, a + b\n    return a\n")
    src = engine.new_sequence()
    engine.forward_last(src, text)
    fork = engine.fork(src, 20)
    assert engine.tokens(fork) == text[:20] and engine.length(src) == len(text)     # the source unchanged
    more = tok.encode("\n\nprint(fibonacci(10))")
    got = engine.forward(fork, more)          # the queued stream copy happens at this decode
    engine.truncate(src, 20)
    assert np.array_equal(got, engine.forward(src, more))
    with pytest.raises(Exception, match="cannot fork"):
        engine.fork(src, 10_000)
    engine.free(fork)
    engine.free(src)


def test_a_short_shared_prefix_is_forked_and_the_conversation_kept(qwen):
    engine, tok = qwen
    cache = PrefixCache(engine, slots=2)
    head = tok.encode("You are a terse assistant for Python questions. Reply in one line; never import "
                      "third-party packages.\n")
    first = head + tok.encode("Q: how do I sort a list of tuples by their second item, in place, without "
                              "importing anything, and keep equal items in their order?\nA:")
    one = generate_plain(engine, first, 6, cache=cache)
    second = head + tok.encode("Q: what does zip do?\nA:")
    shared = common_prefix(first, second)
    assert FORK_ENOUGH <= shared < SHARED_ENOUGH and 2 * shared < len(first)      # not reused whole
    two = generate_plain(engine, second, 6, cache=cache)
    assert two.cached_tokens == shared and cache.stats["forks"] == 1
    assert [t.n_tokens for t in two.timings if t.kind == "prefill"] == [len(second) - shared]
    assert tok.decode(two.tokens, skip_special=True).strip()
    again = first + one.tokens + tok.encode(" Thanks.")     # the first conversation's next turn: still held
    three = generate_plain(engine, again, 4, cache=cache)
    assert three.cached_tokens >= len(first)
    cache.clear()
    assert engine.active_sequences == 0
