"""The SUN hub's endpoint (server/sun_http.py) under the shared field rule, with the official
`openai` client: what the hub honours works, what its decoder cannot do (penalties, logit_bias) is
a 400 naming the field, and a star with no decoder online answers 503 with Retry-After. (tools,
response_format and logprobs through SUN: tests/system/test_sun_agent_api.py.)"""
from __future__ import annotations

import json
import urllib.request

import openai
import pytest
import torch

from edge.engines.torch_engine import TorchEngine
from edge.model.sun_modules import weights_fingerprint
from edge.sun.prefill import PrefillWorker
from edge.sun.prefill_node import PrefillNode
from edge.wire.memory_link import MemoryBus, MemoryLink
from edge.wire.protocol import sun_hello_topic
from harness.http_endpoints import byte_tokenizer, sun_http_endpoint
from harness.sun_star import KEY
from harness.tiny_models import random_model, specialist
from harness.waiting import wait_until
from server.hub import Hub
from server.sun_http import RETRY_AFTER_S, start_sun_http

torch.set_num_threads(1)
HI = [{"role": "user", "content": "hi"}]


def client_of(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="none", max_retries=0)


@pytest.fixture(scope="module")
def client():
    endpoint = sun_http_endpoint(("maths", "code"))
    server = next(endpoint)[0]
    yield client_of(server)
    next(endpoint, None)


def refused(call, **kw):
    with pytest.raises(openai.BadRequestError) as e:
        call(**kw)
    return e.value.body


def test_what_the_decoder_cannot_do_is_a_400_naming_it(client):
    chat, comp = client.chat.completions.create, client.completions.create
    for call, kw, field in ((chat, {"messages": HI, "frequency_penalty": 1.0}, "frequency_penalty"),
                            (comp, {"prompt": "x", "presence_penalty": -1.0}, "presence_penalty"),
                            (comp, {"prompt": "x", "logit_bias": {"3": 5}}, "logit_bias"),
                            (comp, {"prompt": "x", "extra_body": {"repetition_penalty": 1.2}}, "repetition_penalty")):
        body = refused(call, model="maths", max_tokens=2, **kw)
        assert body["param"] == field and "SUN hub" in body["message"], body
    # honoured now, but this base's template renders no tools: the same 400 a target gives
    body = refused(chat, model="maths", messages=HI, tools=[{"type": "function", "function": {"name": "f"}}])
    assert body["param"] == "tools" and "template" in body["message"], body
    assert refused(comp, model="maths", prompt="x", extra_body={"min_tokens": 2})["param"] == "min_tokens"
    assert refused(comp, model="maths", prompt="x", n=2)["param"] == "n"
    assert refused(comp, model="poetry", prompt="x")["param"] == "model"


def test_neutral_values_pass_and_honoured_fields_work(client):
    plain = client.completions.create(model="code", prompt="abc", max_tokens=6, temperature=0)
    same = client.completions.create(model="code", prompt="abc", max_tokens=6, temperature=0, frequency_penalty=0,
                                     presence_penalty=0.0, logit_bias={}, user="u", n=1)
    assert same.choices[0].text == plain.choices[0].text and plain.usage.completion_tokens == 6
    out = client.chat.completions.create(model="maths", messages=HI, max_completion_tokens=4, temperature=0)
    assert out.usage.completion_tokens == 4 and out.choices[0].logprobs is None
    chunks = list(client.chat.completions.create(model="maths", messages=HI, max_completion_tokens=4,
                                                 temperature=0, stream=True, stream_options={"include_usage": True}))
    assert chunks[-1].choices == [] and chunks[-1].usage.model_dump() == out.usage.model_dump()
    assert "".join(c.choices[0].delta.content or "" for c in chunks[:-1]) == out.choices[0].message.content


@pytest.fixture(scope="module")
def no_decoder():
    """A hub whose SUN router has a prefill worker for "maths" and no decoder at all."""
    base = random_model()
    bus = MemoryBus()
    hub = Hub(link=MemoryLink(bus), hub_id="hub", ctl_key=KEY).start()
    link = MemoryLink(bus)
    node = PrefillNode(PrefillWorker(TorchEngine(specialist(base, 20), fingerprint=weights_fingerprint(base)),
                                     "maths", kv_dtype="float64"), link, "prefill-maths", KEY)
    link.set_will(sun_hello_topic("prefill-maths"), node.will())
    link.connect()
    node.start()
    assert wait_until(lambda: hub.router.tasks() == ["maths"])
    server = start_sun_http(hub, byte_tokenizer(), port=0, timeout=20)
    yield server
    server.stop()
    node.stop()
    link.close()
    hub.stop()


def test_no_decoder_online_is_a_503_with_retry_after(no_decoder):
    client = client_of(no_decoder)
    for stream in (False, True):
        with pytest.raises(openai.APIStatusError) as e:
            out = client.completions.create(model="maths", prompt="abc", max_tokens=4, stream=stream)
            list(out) if stream else None
        assert e.value.status_code == 503, e.value
        assert e.value.response.headers["retry-after"] == str(RETRY_AFTER_S)
        assert "no_decoder" in e.value.body["message"] and e.value.body["type"] == "service_unavailable"
    with urllib.request.urlopen(f"http://127.0.0.1:{no_decoder.port}/health", timeout=10) as r:
        assert json.loads(r.read()) == {"status": "ok"}
