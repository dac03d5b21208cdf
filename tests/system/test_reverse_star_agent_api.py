"""A drafting device's OpenAI endpoint speaks the agent API (#46): response_format json_schema, tools
with tool_choice required or named, and logprobs, all served from the hub's target.

A reverse star on the in-memory bus (float64 tiny llamas, byte-level BPE with a template that renders
tools the Qwen2.5 way): the hub's verify service masks its target's rows by each request's grammar
and reports logprobs from them; the device drafts under the same grammar. Beside it, the same target
alone behind a target's endpoint (generate_plain). Every json_schema answer validates, greedy and
sampled; a forced tool_choice gives calls whose arguments validate, parsed by the endpoint's own
parser; greedy answers -- content, tool calls and logprobs -- equal the target alone's; penalties
are still a 400 that says why, and the endpoint keeps serving.
"""
import json

import pytest

pytest.importorskip("llguidance")
jsonschema = pytest.importorskip("jsonschema")

from edge.api.openai_http import OpenAIServer  # noqa: E402
from edge.cli.drafter_role import DRAFTER, endpoint_generate  # noqa: E402
from edge.speculative.generate import generate_plain  # noqa: E402
from edge.speculative.grammar import grammar_tokenizer  # noqa: E402
from edge.star.drafting_device import DraftingDevice  # noqa: E402
from edge.star.hub_client import HubClient  # noqa: E402
from edge.wire.memory_link import MemoryBus, MemoryLink  # noqa: E402
from server.hub import Hub  # noqa: E402

from harness.grammars import bpe_tokenizer, tiny_pair  # noqa: E402
from harness.http_endpoints import post  # noqa: E402
from harness.sun_grammars import PERSON, TOOL_TEMPLATE  # noqa: E402

CHAT = "/v1/chat/completions"
ASK = [{"role": "user", "content": "weather in Rome?"}]
ADD = {"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "required": ["a", "b"], "additionalProperties": False,
    "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                   "b": {"type": "integer", "minimum": 0, "maximum": 99}}}}}
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "required": ["city"], "additionalProperties": False,
    "properties": {"city": {"type": "string", "maxLength": 8}}}}}
TOOLS = [WEATHER, ADD]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
LIST = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "minItems": 1, "maxItems": 4}


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    tok = bpe_tokenizer(tmp_path_factory.mktemp("tok") / "t")
    tok.chat_template = TOOL_TEMPLATE
    target, draft = tiny_pair(tok.vocab_size, max_len=1024)
    bus, fp = MemoryBus(), tok.fingerprint()
    hub = Hub(link=MemoryLink(bus, "hub"), verify_engine=target, tokenizer_fp=fp, status_every=60.0,
              verify_grammars=lambda: grammar_tokenizer(tok, target.vocab_size)).start()
    device = DraftingDevice(draft, HubClient(MemoryLink(bus, "pi"), "pi", fp, tok.vocab_size, role="drafter"), gamma=3)
    drafter = OpenAIServer(endpoint_generate(device), tok, "tiny", port=0, context=1024, profile=DRAFTER).start()
    alone = tiny_pair(tok.vocab_size, max_len=1024)[0]          # the same target, its own engine

    def plain(ids, max_new, params, stop_ids=(), on_token=None, on_logits=None, grammar=None):
        return generate_plain(alone, ids, max_new, params, stop_ids, on_token, on_logits, grammar=grammar)
    reference = OpenAIServer(plain, tok, "tiny", port=0, context=1024).start()
    yield drafter, reference, hub
    drafter.stop()
    reference.stop()
    device.close()
    device.hub.close()
    hub.stop()


def schema_format(schema):
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}}


@pytest.mark.parametrize("schema", [PERSON, LIST], ids=["object", "array"])
@pytest.mark.parametrize("kw", [{"temperature": 0}, {"temperature": 1.0, "seed": 3}, {"temperature": 0.8, "seed": 4}])
def test_json_schema_answers_validate(servers, schema, kw):
    r = post(servers[0], CHAT, {"messages": ASK, "max_tokens": 200, "response_format": schema_format(schema), **kw})
    choice = r["choices"][0]
    assert choice["finish_reason"] == "stop", choice
    jsonschema.validate(json.loads(choice["message"]["content"]), schema)


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "add"}}],
                         ids=["required", "named"])
@pytest.mark.parametrize("kw", [{"temperature": 0}, {"temperature": 1.0, "seed": 7}])
def test_a_forced_tool_choice_gives_valid_calls(servers, choice, kw):
    r = post(servers[0], CHAT, {"messages": ASK, "tools": TOOLS, "tool_choice": choice, "max_tokens": 300, **kw})
    c = r["choices"][0]
    assert c["finish_reason"] == "tool_calls" and c["message"]["tool_calls"], c
    for call in c["message"]["tool_calls"]:
        name = call["function"]["name"]
        assert name in SCHEMAS and (choice == "required" or name == "add")
        jsonschema.validate(json.loads(call["function"]["arguments"]), SCHEMAS[name])


@pytest.mark.parametrize("body", [
    {"response_format": schema_format(PERSON), "logprobs": True, "top_logprobs": 3},
    {"tools": TOOLS, "tool_choice": "required", "logprobs": True, "top_logprobs": 2},
    {"logprobs": True, "top_logprobs": 4, "max_tokens": 24},
], ids=["json-schema", "tool-call", "free-text"])
def test_greedy_answers_and_logprobs_are_the_target_alones(servers, body):
    drafter, reference, hub = servers
    ask = {"messages": ASK, "max_tokens": 200, "temperature": 0, **body}
    got, want = post(drafter, CHAT, ask)["choices"][0], post(reference, CHAT, ask)["choices"][0]
    for k in ("finish_reason",):
        assert got[k] == want[k]
    assert got["message"].get("content") == want["message"].get("content")
    calls = [(c["function"]["name"], c["function"]["arguments"]) for c in got["message"].get("tool_calls") or []]
    assert calls == [(c["function"]["name"], c["function"]["arguments"])
                     for c in want["message"].get("tool_calls") or []]
    g, w = got["logprobs"]["content"], want["logprobs"]["content"]
    assert [e["token"] for e in g] == [e["token"] for e in w] and g
    for a, b in zip(g, w):
        assert abs(a["logprob"] - b["logprob"]) < 1e-9
        assert [t["token"] for t in a["top_logprobs"]] == [t["token"] for t in b["top_logprobs"]]
        assert all(abs(x["logprob"] - y["logprob"]) < 1e-9 for x, y in zip(a["top_logprobs"], b["top_logprobs"]))
    assert hub.verify.snapshot()["counters"].get("accepted", 0) > 0      # the device's drafts were verified


def test_penalties_are_still_a_400_and_the_endpoint_keeps_serving(servers):
    import urllib.error
    drafter = servers[0]
    with pytest.raises(urllib.error.HTTPError) as e:
        post(drafter, CHAT, {"messages": ASK, "max_tokens": 8, "presence_penalty": 1.0})
    err = json.loads(e.value.read())["error"]
    assert e.value.code == 400 and err["param"] == "presence_penalty" and "penalties" in err["message"]
    ask = {"messages": ASK, "max_tokens": 8, "temperature": 0}
    assert post(drafter, CHAT, ask)["choices"][0]["message"] == post(servers[1], CHAT, ask)["choices"][0]["message"]


def test_a_streamed_constrained_answer_is_the_whole_one(servers):
    """Streamed (SSE) with logprobs: the same text and the same entries as the answer in one piece."""
    drafter = servers[0]
    ask = {"messages": ASK, "max_tokens": 200, "temperature": 0, "response_format": schema_format(PERSON),
           "logprobs": True, "top_logprobs": 2}
    whole = post(drafter, CHAT, ask)["choices"][0]
    chunks = [json.loads(line[6:]) for line in post(drafter, CHAT, {**ask, "stream": True}, raw=True).splitlines()
              if line.startswith("data: {")]
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    entries = [e for c in chunks if c["choices"] and c["choices"][0].get("logprobs")
               for e in c["choices"][0]["logprobs"]["content"]]
    assert text == whole["message"]["content"] and entries == whole["logprobs"]["content"]
