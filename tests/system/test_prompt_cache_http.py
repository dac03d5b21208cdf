"""The OpenAI endpoint of a StarSD target with a prompt cache: usage.prompt_tokens_details.cached_tokens
says how many prompt tokens a conversation's next turn reused, whole or streamed (the final usage
chunk), also when a stop text ends the reply; the answers are the target's cold ones."""
from __future__ import annotations

import json

import pytest
import torch

from edge.speculative.generate import generate_plain
from edge.speculative.sampling import SamplingParams
from harness.http_endpoints import openai_endpoint, post, tiny_engine

torch.set_num_threads(1)
SYSTEM = "You are a terse assistant. " * 6


@pytest.fixture(scope="module")
def endpoint():
    yield from openai_endpoint(prompt_cache=4)


def cold(tok, messages, n):
    ids = tok.encode(tok.apply_chat_template(messages))
    return tok.decode(generate_plain(tiny_engine(0), ids, n, SamplingParams(), tuple(tok.eos_ids)).tokens)


def test_the_next_turn_reports_its_cached_prompt_tokens(endpoint):
    server, star, tok = endpoint
    msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "hi"}]
    one = post(server, "/v1/chat/completions", {"messages": msgs, "max_tokens": 8, "temperature": 0})
    assert one["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    reply = one["choices"][0]["message"]["content"]
    assert reply == cold(tok, msgs, 8)
    msgs += [{"role": "assistant", "content": reply}, {"role": "user", "content": "more"}]
    two = post(server, "/v1/chat/completions", {"messages": msgs, "max_tokens": 8, "temperature": 0})
    cached = two["usage"]["prompt_tokens_details"]["cached_tokens"]
    shared = len(tok.encode(tok.apply_chat_template(msgs[:2])))
    assert shared <= cached < two["usage"]["prompt_tokens"]
    assert two["choices"][0]["message"]["content"] == cold(tok, msgs, 8)

    events = post(server, "/v1/chat/completions", {"messages": msgs, "max_tokens": 8, "temperature": 0,
                                                   "stream": True, "stream_options": {"include_usage": True}},
                  raw=True).split("\n\n")
    last = json.loads(events[-3][len("data: "):])
    assert last["choices"] == [] and last["usage"]["prompt_tokens_details"]["cached_tokens"] == \
        two["usage"]["prompt_tokens"] - 1          # the same prompt again: all but its last token


def test_a_reply_ended_by_a_stop_text_still_reports_the_reuse(endpoint):
    server, _, tok = endpoint
    prompt = SYSTEM + "Q: and then?"
    post(server, "/v1/completions", {"prompt": prompt, "max_tokens": 4, "temperature": 0})
    text = post(server, "/v1/completions", {"prompt": prompt, "max_tokens": 8, "temperature": 0})["choices"][0]["text"]
    assert len(text) >= 2
    out = post(server, "/v1/completions", {"prompt": prompt, "max_tokens": 8, "temperature": 0, "stop": [text[1]]})
    assert out["choices"][0]["finish_reason"] == "stop" and out["choices"][0]["text"] == text[:1]
    n = len(tok.encode(prompt, add_special=True))
    assert out["usage"]["prompt_tokens_details"]["cached_tokens"] == n - 1
