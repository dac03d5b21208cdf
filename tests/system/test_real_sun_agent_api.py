"""Acceptance: Qwen2.5-Coder-0.5B as the SUN base, called as agents call it (#45 item 2).

A SUN star on the session's Mosquitto: the hub's router and OpenAI endpoint (the Qwen tokenizer
and chat template), one prefill worker and one shared decoder, each on its own MQTT link, both on
llama.cpp over ONE load of the Q4_K_M GGUF (the decoder a second context of the prefill engine's
model, edge/sun/llamacpp_sibling.py: the kit's colocated layout), 1 thread each. The prefill
worker is the bare base (no adapter: a SUN task here is the base itself -- what matters is the
path a request takes). Both workers follow grammars with the GGUF's own tokenizer. The official
openai client asks for: a json_schema answer (it validates), a forced tool call and an auto one
(valid calls of the tool), a streamed call (id and name first, arguments adding up), logprobs
(one entry per token, the greedy token first among its alternatives) and a grammar request and a
free one at once (both complete; that a free row is untouched by a batch mate's grammar is shown
exactly on float64 torch in tests/unit/test_sun_row_grammars.py: llama.cpp's batched rows are not
bit-identical to a row alone, tests/system/test_parallel_llamacpp.py).

The model is fetched by `make test` (make test-models); without the file the module skips.
"""
from __future__ import annotations

import json
import os
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import openai
import pytest

from harness.agent_asks import WEATHER, city_schema, fetched_or_skip, json_ask, tool_ask
from harness.waiting import wait_until

MODEL = "qwen2.5-coder-0.5b"
QWEN, = fetched_or_skip(MODEL)
pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (pip install .[llama])")

pytestmark = [pytest.mark.slow, pytest.mark.real_model, pytest.mark.llamacpp, pytest.mark.broker,
              pytest.mark.xdist_group("real_sun_agent_api")]

TASK = "agent"
KEY = b"q" * 32
TOOL_ASK = tool_ask(TASK)
CITY = city_schema(max_length=20)
JSON_ASK = json_ask(TASK, CITY)


@pytest.fixture(scope="module")
def star(mosquitto):
    from edge.engines.llamacpp_engine import LlamaCppEngine
    from edge.model.checkpoint_files import load_tokenizer
    from edge.sun.decoder import SharedDecoder
    from edge.sun.decoder_node import DecoderNode
    from edge.sun.llamacpp_sibling import SiblingContext
    from edge.sun.prefill import PrefillWorker
    from edge.sun.prefill_node import PrefillNode
    from edge.sun.token_rules import SunGrammars
    from edge.wire.link import MqttLink
    from edge.wire.protocol import sun_hello_topic
    from server.hub import Hub
    from server.sun_http import start_sun_http
    tok, pid = load_tokenizer(QWEN), os.getpid()
    hub = Hub(broker_url=mosquitto.url, hub_id=f"hq-{pid}", ctl_key=KEY, status_every=0.5).start()
    pre = LlamaCppEngine(QWEN, max_len=2048, n_seq_max=1, threads=1)
    grammars = SunGrammars(tok, pre.vocab_size).prepare()
    nodes, links = [], []
    for name, make in (
            ("prefill-q", lambda ln: PrefillNode(PrefillWorker(pre, TASK, grammars=grammars), ln, "prefill-q", KEY)),
            ("decoder-q", lambda ln: DecoderNode(SharedDecoder(SiblingContext(pre, n_seq_max=4, threads=1),
                                                               max_batch=4, stop_ids=tok.eos_ids, name="decoder-q",
                                                               grammars=grammars), ln, "decoder-q", KEY))):
        link = MqttLink(mosquitto.url, client_id=f"{name}-{pid}")
        node = make(link)
        link.set_will(sun_hello_topic(name), node.will())
        link.connect(5)
        links.append(link)
        nodes.append(node.start())
        assert wait_until(lambda: name in hub.router.workers and hub.router.workers[name].online, 30), name
    server = start_sun_http(hub, tok, port=0, context=2048, timeout=240)
    yield openai.OpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="none", max_retries=0,
                        timeout=240), nodes
    server.stop()
    for n in nodes:
        n.stop()
    for ln in links:
        ln.close()
    hub.stop()
    nodes[1].decoder.engine.close()
    pre.close()


@pytest.fixture(scope="module")
def client(star):
    return star[0]


def weather_call(r, name="get_weather"):
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.tool_calls, r.model_dump_json(exclude_none=True)
    call = c.message.tool_calls[0]
    assert call.function.name == name and call.id.startswith("call_")
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, WEATHER["function"]["parameters"])
    return args


def test_response_format_json_schema(client):
    out = client.chat.completions.create(**JSON_ASK)
    jsonschema.validate(json.loads(out.choices[0].message.content), CITY)


def test_tool_calls_auto_and_forced(client):
    assert "Paris" in weather_call(client.chat.completions.create(**TOOL_ASK))["city"]
    assert weather_call(client.chat.completions.create(**TOOL_ASK, tool_choice="required"))["city"]


def test_a_streamed_tool_call(client):
    calls, finish = {}, None
    for chunk in client.chat.completions.create(**TOOL_ASK, tool_choice="required", stream=True):
        if not chunk.choices:
            continue
        finish = chunk.choices[0].finish_reason or finish
        for tc in chunk.choices[0].delta.tool_calls or ():
            c = calls.setdefault(tc.index, {"id": None, "name": "", "arguments": ""})
            if tc.id:
                assert not c["arguments"]                   # id and name first
                c["id"], c["name"] = tc.id, tc.function.name
            c["arguments"] += tc.function.arguments or ""
    assert finish == "tool_calls" and calls[0]["name"] == "get_weather" and calls[0]["id"].startswith("call_")
    jsonschema.validate(json.loads(calls[0]["arguments"]), WEATHER["function"]["parameters"])


def test_logprobs(client):
    out = client.chat.completions.create(**JSON_ASK, logprobs=True, top_logprobs=3)
    content = out.choices[0].logprobs.content
    assert len(content) == out.usage.completion_tokens               # the stop token: neither (as a target's)
    assert "".join(e.token for e in content) == out.choices[0].message.content
    for e in content:
        assert e.logprob <= 0 and e.top_logprobs[0].token == e.token
        assert e.top_logprobs[0].logprob == pytest.approx(e.logprob, abs=1e-5)


def test_a_grammar_and_a_free_request_at_once(client):
    free = dict(model=TASK, messages=[{"role": "user", "content": "Say hello in French."}], temperature=0,
                max_tokens=12)
    with ThreadPoolExecutor(2) as pool:
        held, plain = pool.submit(client.chat.completions.create, **JSON_ASK), pool.submit(
            client.chat.completions.create, **free)
        jsonschema.validate(json.loads(held.result().choices[0].message.content), CITY)
        answer = plain.result().choices[0]                # llama.cpp's batched rows are not bit-identical to
        assert answer.message.content.strip() and answer.finish_reason in ("stop", "length")   # one alone
