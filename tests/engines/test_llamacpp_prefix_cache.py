"""The prompt cache (edge/speculative/prefix_cache.py) on llama.cpp with the real Qwen2.5-Coder-0.5B:
a conversation's next turn reuses the KV (cached_tokens through the OpenAI endpoint too), the
held sequences count against n_seq_max (a request always gets one), and the answers are well
formed. llama.cpp's one-token and many-token calls differ in their last bits, so a reused
prefix is not bit-identical to a cold prefill: tokens are compared only where noted."""
from __future__ import annotations

import functools
import json
import urllib.request

import pytest

from harness.agent_asks import qwen_llamacpp
from edge.speculative.generate import generate_plain
from edge.speculative.prefix_cache import PrefixCache

SYSTEM = ("You are a careful Python reviewer. Answer in one short sentence. "
          "Prefer the standard library; never use global state. ") * 3


@pytest.fixture(scope="module")
def qwen():
    engine, tok = qwen_llamacpp(max_len=1024)
    yield engine, tok
    engine.close()


def ids_of(tok, messages):
    return tok.encode(tok.apply_chat_template(messages))


def test_the_next_turn_reuses_the_conversation(qwen):
    engine, tok = qwen
    cache = PrefixCache(engine, slots=2)
    stops = tuple(tok.eos_ids)
    msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "How do I reverse a list?"}]
    one = generate_plain(engine, ids_of(tok, msgs), 8, stop_ids=stops, cache=cache)
    cold_one = generate_plain(engine, ids_of(tok, msgs), 8, stop_ids=stops)    # no cache: a fresh sequence
    assert one.cached_tokens == 0 and one.tokens == cold_one.tokens           # both prefilled cold
    reply = tok.decode(one.tokens, skip_special=True)
    msgs += [{"role": "assistant", "content": reply}, {"role": "user", "content": "And a string?"}]
    prompt = ids_of(tok, msgs)
    two = generate_plain(engine, prompt, 8, stop_ids=stops, cache=cache)
    assert two.cached_tokens >= len(ids_of(tok, msgs[:2])) and two.cached_tokens < len(prompt)
    text = tok.decode(two.tokens, skip_special=True)
    assert text.strip() and "\ufffd" not in text                              # a well formed answer
    prefill = [t.n_tokens for t in two.timings if t.kind == "prefill"]
    assert prefill == [len(prompt) - two.cached_tokens]                      # only the new turn was fed
    again = generate_plain(engine, prompt, 8, stop_ids=stops, cache=cache)
    assert again.cached_tokens == len(prompt) - 1 and tok.decode(again.tokens, skip_special=True).strip()
    assert engine.active_sequences == len(cache) <= 2
    cache.clear()


def test_held_sequences_yield_to_a_request_on_a_full_context(qwen):
    engine, tok = qwen
    cache = PrefixCache(engine, slots=8)                        # more than n_seq_max = 3
    for word in ("Apples", "Rivers", "Zebras", "Quartz", "Violins"):     # nothing shared: 5 conversations
        r = generate_plain(engine, tok.encode(f"{word} are"), 3, cache=cache)
        assert r.n_generated == 3 and engine.active_sequences == len(cache) <= 3
    assert cache.stats["evicted"] >= 2
    cache.clear()
    assert engine.active_sequences == 0


def test_the_endpoint_reports_cached_tokens(qwen):
    from edge.api.openai_http import OpenAIServer
    engine, tok = qwen
    cache = PrefixCache(engine, slots=2)
    server = OpenAIServer(functools.partial(generate_plain, engine, cache=cache), tok, "qwen", port=0,
                          context=engine.max_len).start()
    try:
        msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "What is a tuple?"}]
        first = _post(server, {"messages": msgs, "max_tokens": 12, "temperature": 0})
        assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        msgs += [first["choices"][0]["message"], {"role": "user", "content": "Thanks."}]
        second = _post(server, {"messages": msgs, "max_tokens": 12, "temperature": 0,
                                "stream": True, "stream_options": {"include_usage": True}}, stream=True)
        usage = second[-1]["usage"]
        assert 0 < usage["prompt_tokens_details"]["cached_tokens"] < usage["prompt_tokens"]
        assert "".join(c["choices"][0]["delta"].get("content", "") for c in second[:-1] if c["choices"]).strip()
    finally:
        server.stop()
        cache.clear()


def _post(server, body, stream=False):
    req = urllib.request.Request(f"http://127.0.0.1:{server.port}/v1/chat/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        raw = r.read().decode()
    if not stream:
        return json.loads(raw)
    return [json.loads(e[len("data: "):]) for e in raw.split("\n\n") if e.startswith("data: {")]
