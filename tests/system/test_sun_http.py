"""The hub's OpenAI-compatible SUN endpoint (server/sun_http.py): "model" names the task.

A hub on an in-memory bus hosts the shared decoder; two prefill workers serve
"maths" and "code". Each HTTP answer must be the text of what the same
specialist and decoder give in-process (split_generate, greedy, float64).
"""
import json
import threading
import urllib.error
import urllib.request

import pytest
import torch

from edge.model.sun_modules import split_generate
from harness.http_endpoints import post, sun_http_endpoint

torch.set_num_threads(1)
TASKS = ("maths", "code")


@pytest.fixture(scope="module")
def sun_endpoint():
    yield from sun_http_endpoint(TASKS)


def expect(tok, base, spec, prompt, max_new):
    ids = tok.encode(prompt, add_special=True)
    stream = tok.decode_stream(skip_special=True)     # as the endpoint decodes (bytes held until whole)
    return "".join(stream.put(t) for t in split_generate(spec, base, [ids], max_new, tuple(tok.eos_ids))[0])


def test_models_are_the_tasks_and_answers_are_the_specialists(sun_endpoint):
    server, tok, base, specs = sun_endpoint
    with urllib.request.urlopen(f"http://127.0.0.1:{server.port}/v1/models", timeout=10) as r:
        assert [m["id"] for m in json.loads(r.read())["data"]] == sorted(TASKS)
    out = {}

    def ask(task):                      # both tasks at once: the shared decoder batches them
        out[task] = post(server, "/v1/completions", {"model": task, "prompt": "hello", "max_tokens": 10,
                                                     "temperature": 0})
    threads = [threading.Thread(target=ask, args=(t,)) for t in TASKS]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    for t in TASKS:
        assert out[t]["model"] == t
        assert out[t]["choices"][0]["text"] == expect(tok, base, specs[t], "hello", 10)
        assert out[t]["usage"]["completion_tokens"] == 10
    assert out["maths"]["choices"][0]["text"] != out["code"]["choices"][0]["text"]


def test_streamed_answer_equals_the_whole_one(sun_endpoint):
    server, tok, base, specs = sun_endpoint
    body = {"model": "code", "prompt": "abc", "max_tokens": 8, "temperature": 0}
    events = post(server, "/v1/completions", {**body, "stream": True}, raw=True).split("\n\n")
    chunks = [json.loads(e[6:]) for e in events if e.startswith("data: {")]
    assert "".join(c["choices"][0]["text"] for c in chunks) == expect(tok, base, specs["code"], "abc", 8)
    assert events[-2] == "data: [DONE]"


def test_unknown_task_is_a_clear_400(sun_endpoint):
    server, *_ = sun_endpoint
    with pytest.raises(urllib.error.HTTPError) as e:
        post(server, "/v1/completions", {"model": "poetry", "prompt": "x", "max_tokens": 2})
    assert e.value.code == 400
    msg = json.loads(e.value.read())["error"]["message"]
    assert "poetry" in msg and "code, maths" in msg
