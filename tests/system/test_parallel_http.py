"""Several requests at once on a device (--parallel N, edge/api/admission.py): up to N generate together
on one engine (edge/engines/batched_calls.py), each drafting through the star on its own hub session; each
answer equals the one served alone (tiny float64 models: exact), usage and cached_tokens included; past the
queue a request is answered 503 with Retry-After."""
from __future__ import annotations

import json
import threading
import urllib.error
import urllib.request

import pytest
import torch

from edge.api.openai_http import OpenAIServer
from edge.speculative.generate import GenResult, generate_plain
from edge.speculative.sampling import SamplingParams
from harness.at_once import all_at_once
from harness.http_endpoints import byte_tokenizer, openai_endpoint, post, tiny_engine

torch.set_num_threads(1)
PROMPTS = ["def add(a, b):", "The quick brown fox", "x", "Once upon a time, in a land far away, "]
LENGTHS = [24, 10, 30, 16]


@pytest.fixture(scope="module")
def endpoint():
    yield from openai_endpoint(prompt_cache=8, parallel=4)     # room for every conversation: no eviction


def cold(tok, prompt, n):
    ids = tok.encode(prompt, add_special=True)
    return tok.decode(generate_plain(tiny_engine(0), ids, n, SamplingParams(), tuple(tok.eos_ids)).tokens)


def at_once(server, bodies):
    return all_at_once([lambda b=b: post(server, "/v1/completions", b) for b in bodies])


def test_four_requests_at_once_through_the_star_each_answer_as_alone(endpoint):
    server, star, tok = endpoint
    bodies = [{"prompt": p, "max_tokens": n, "temperature": 0} for p, n in zip(PROMPTS, LENGTHS)]
    first = at_once(server, bodies)
    assert [g["usage"]["prompt_tokens_details"]["cached_tokens"] for g in first] == [0] * 4
    alone = [post(server, "/v1/completions", b) for b in bodies]     # one at a time; the cache holds each
    again = at_once(server, bodies)
    for f, a, g, p, n in zip(first, alone, again, PROMPTS, LENGTHS):
        assert f["choices"][0]["text"] == a["choices"][0]["text"] == g["choices"][0]["text"]
        assert a["choices"][0]["text"] == cold(tok, p, n)[:len(a["choices"][0]["text"])]
        assert f["usage"]["completion_tokens"] == g["usage"]["completion_tokens"] == n
        m = len(tok.encode(p, add_special=True))
        held = m - 1 if 2 * (m - 1) >= m + n - 1 else 0     # PrefixCache's rule: the prompt, half what it holds
        assert a["usage"]["prompt_tokens_details"]["cached_tokens"] == held
        assert g["usage"]["prompt_tokens_details"]["cached_tokens"] == held
    assert star.counts["generations"] == 12 and star.active == 0
    assert star.engine.inner.active_sequences <= 8                  # the prompt cache's, no more


def test_a_seeded_sampled_request_replays_alone_and_concurrent():
    """A local speculative target (its draft a local model: the drafts, hence the seeded output, do not
    depend on a hub's timing) behind the endpoint: a seeded request answers alike alone and among others."""
    from edge.engines.batched_calls import BatchedCalls
    from edge.speculative.generate import ModelDrafter, generate_speculative
    tok = byte_tokenizer()
    eng, draft = BatchedCalls(tiny_engine(0)), BatchedCalls(tiny_engine(1))

    def generate(prompt_ids, max_new, params, stop_ids=(), on_token=None, on_logits=None, **kw):
        d = ModelDrafter(draft, params)
        try:
            return generate_speculative(eng, d, prompt_ids, max_new, 3, params, stop_ids, on_token,
                                        on_logits=on_logits)
        finally:
            d.close()
    server = OpenAIServer(generate, tok, "tiny", port=0, parallel=4).start()
    try:
        body = {"prompt": "seeded:", "max_tokens": 20, "temperature": 0.9, "top_p": 0.9, "seed": 5,
                "logprobs": 1}
        alone = post(server, "/v1/completions", body)["choices"][0]
        got = at_once(server, [body] + [{"prompt": p, "max_tokens": 12, "temperature": 0} for p in PROMPTS[:3]])
        assert got[0]["choices"][0]["logprobs"]["tokens"] == alone["logprobs"]["tokens"]
        assert got[0]["choices"][0]["text"] == alone["text"]
    finally:
        server.stop()


def test_past_the_queue_a_request_gets_503_with_retry_after():
    tok = byte_tokenizer()
    go, started = threading.Event(), threading.Semaphore(0)

    def generate(prompt_ids, max_new, params, stop_ids=(), on_token=None, **kw):
        started.release()
        go.wait(30)
        on_token(65)
        return GenResult(tokens=[65])
    server = OpenAIServer(generate, tok, "slow", port=0, parallel=1, queue=1).start()
    try:
        results = []
        threads = [threading.Thread(target=lambda: results.append(post(server, "/v1/completions",
                                                                       {"prompt": "a", "max_tokens": 1})))
                   for _ in range(2)]
        threads[0].start()
        assert started.acquire(timeout=10)           # one generating ...
        threads[1].start()
        adm = server.admission
        for _ in range(200):                         # ... one waiting
            if adm.waiting == 1:
                break
            threading.Event().wait(0.01)
        assert adm.running == 1 and adm.waiting == 1
        with pytest.raises(urllib.error.HTTPError) as e:
            post(server, "/v1/completions", {"prompt": "a", "max_tokens": 1})
        assert e.value.code == 503 and e.value.headers["Retry-After"] == "2"
        err = json.loads(e.value.read())["error"]
        assert err["type"] == "service_unavailable" and "--parallel 1" in err["message"] \
            and "--queue 1" in err["message"]
        go.set()
        for t in threads:
            t.join(30)
        assert [r["choices"][0]["text"] for r in results] == [tok.decode([65])] * 2
        assert adm.stats == {"admitted": 2, "queued": 1, "refused": 1} and adm.running == 0
    finally:
        go.set()
        server.stop()


def test_local_generations_at_once_are_batched_and_exact():
    """A local target (no star) behind the endpoint: plain generations, their forwards in shared rounds."""
    from edge.engines.batched_calls import BatchedCalls
    tok = byte_tokenizer()
    eng = BatchedCalls(tiny_engine(0))

    def generate(prompt_ids, max_new, params, stop_ids=(), on_token=None, on_logits=None, **kw):
        return generate_plain(eng, prompt_ids, max_new, params, stop_ids, on_token, on_logits)
    server = OpenAIServer(generate, tok, "tiny", port=0, parallel=4).start()
    try:
        got = at_once(server, [{"prompt": p, "max_tokens": n, "temperature": 0} for p, n in zip(PROMPTS, LENGTHS)])
        for g, p, n in zip(got, PROMPTS, LENGTHS):      # (bytes of an unfinished character are held back)
            text = g["choices"][0]["text"]
            assert text == cold(tok, p, n)[:len(text)] and g["usage"]["completion_tokens"] == n
        assert eng.stats["forwards"] >= sum(LENGTHS) and eng.inner.active_sequences == 0
    finally:
        server.stop()
