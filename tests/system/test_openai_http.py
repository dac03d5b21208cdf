"""The OpenAI-compatible endpoint of a StarSD target (tiny model, byte-level tokenizer)."""
from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest
import torch

from edge.speculative.generate import generate_plain
from edge.api.openai_http import StopText
from edge.speculative.sampling import SamplingParams
from harness.http_endpoints import openai_endpoint, post

torch.set_num_threads(1)
@pytest.fixture(scope="module")
def endpoint():
    yield from openai_endpoint()


def test_completion_is_the_targets_greedy_text(endpoint):
    server, star, tok = endpoint
    out = post(server, "/v1/completions", {"prompt": "hello", "max_tokens": 12, "temperature": 0})
    ids = tok.encode("hello", add_special=True)
    want = generate_plain(star.engine, ids, 12, SamplingParams(), tuple(tok.eos_ids)).tokens
    assert out["object"] == "text_completion" and out["choices"][0]["text"] == tok.decode(want)
    assert out["usage"] == {"prompt_tokens": len(ids), "completion_tokens": 12, "total_tokens": len(ids) + 12,
                            "prompt_tokens_details": {"cached_tokens": 0}}     # this target has no prompt cache
    assert star.last_drafter.stats.answered > 0


def test_chat_stream_equals_the_non_streamed_answer(endpoint):
    server, _, _ = endpoint
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 10, "temperature": 0}
    whole = post(server, "/v1/chat/completions", body)
    text = whole["choices"][0]["message"]["content"]
    events = post(server, "/v1/chat/completions", {**body, "stream": True}, raw=True).split("\n\n")
    assert events[-2] == "data: [DONE]"
    chunks = [json.loads(e[len("data: "):]) for e in events[:-2]]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == text
    assert chunks[-1]["choices"][0]["finish_reason"] == whole["choices"][0]["finish_reason"]


def test_bad_requests_get_clear_400s(endpoint):
    server, _, _ = endpoint
    for path, body, msg in (("/v1/completions", {"prompt": 5}, "prompt"),
                            ("/v1/chat/completions", {"messages": []}, "messages"),
                            ("/v1/completions", {"prompt": "x", "temperature": 9}, "temperature"),
                            ("/v1/completions", {"prompt": "x", "n": 2}, "n=1")):
        with pytest.raises(urllib.error.HTTPError) as e:
            post(server, path, body)
        assert e.value.code == 400 and msg in json.loads(e.value.read())["error"]["message"]
    models_ = json.loads(urllib.request.urlopen(f"http://127.0.0.1:{server.port}/v1/models").read())
    assert models_["data"][0]["id"] == "tiny"


def test_stop_text_cuts_and_holds_back_partial_matches():
    cut = StopText(["END"])
    assert cut.feed("abc E") == "abc "          # "E" may start END: held back
    assert cut.feed("N") == ""
    assert cut.feed("D tail") == "" and cut.hit and cut.text == "abc E"[:4]
    plain = StopText(["xyz"])
    assert plain.feed("hello x") + plain.feed("q") + plain.flush() == "hello xq"
