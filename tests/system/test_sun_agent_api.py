"""The SUN hub's endpoint speaks the agent API (issue 45): tools, response_format, logprobs.

A real SUN star over Mosquitto (harness/sun_grammars.py: the hub's router and endpoint, prefill
workers and decoders each on its own MQTT link; tiny float64 models over a byte-level BPE whose
template renders tools the Qwen2.5 way), called with the official `openai` client. JSON-schema
answers validate, greedy and sampled, and the greedy ones are exactly the reference masked split
generation, and so does every answer to the fuzzed bounded schemas a target's endpoint is
tested with; a forced tool call through a SUN task is a valid call, streamed as a target streams
it; logprobs are the reference's masked rows'; requests with different grammars and none at once
each keep their own answer; a grammar goes only to workers that follow grammars, and a task with
none is a 400 saying what to start while its plain requests are served.
"""
from __future__ import annotations

import json
import threading

import pytest

pytest.importorskip("llguidance")
jsonschema = pytest.importorskip("jsonschema")
openai = pytest.importorskip("openai")

from edge.api.request import parse_request  # noqa: E402
from edge.api.request_fields import SUN_HUB  # noqa: E402
from edge.speculative.grammar import grammar_from_json_schema  # noqa: E402
from harness.grammars import bpe_tokenizer  # noqa: E402
from harness.sun_grammars import PERSON, POINT, TOOL_TEMPLATE, AgentSunStar, reference  # noqa: E402
from harness.sun_star import KEY  # noqa: E402
from harness.waiting import wait_until  # noqa: E402

ASK = [{"role": "user", "content": "answer in JSON"}]
SCHEMAS = [PERSON, POINT, {"type": "array", "items": {"enum": ["a", "b", 3]}, "minItems": 1, "maxItems": 3},
           {"anyOf": [{"type": "boolean"}, {"type": "integer", "minimum": 0, "maximum": 50}]},
           {"type": "object", "properties": {"tag": {"type": "string", "maxLength": 4}}, "required": ["tag"],
            "additionalProperties": False}]
ADD = {"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "required": ["a", "b"], "additionalProperties": False,
    "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                   "b": {"type": "integer", "minimum": 0, "maximum": 99}}}}}
CITY = {"type": "function", "function": {"name": "city", "parameters": {
    "type": "object", "required": ["name"], "additionalProperties": False,
    "properties": {"name": {"type": "string", "maxLength": 6}}}}}
TOOLS = [ADD, CITY]
ARGS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


def fmt(schema):
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}}


@pytest.fixture(scope="module")
def star(mosquitto, tmp_path_factory):
    tok = bpe_tokenizer(tmp_path_factory.mktemp("tok") / "t")
    tok.chat_template = TOOL_TEMPLATE
    s = AgentSunStar(mosquitto.url, tok, KEY)
    yield s
    s.close()


@pytest.fixture(scope="module")
def client(star):
    return openai.OpenAI(base_url=f"http://127.0.0.1:{star.server.port}/v1", api_key="none", max_retries=0,
                         timeout=60)


def expected(star, body, schema=None, logprobs=None):
    """The reference answer's (text, entries) for a chat body on task "json"'s specialist."""
    ids = parse_request(body, True, star.tok, body["model"], SUN_HUB, 4096).ids
    g = star.grammars.compile(grammar_from_json_schema(schema)) if schema is not None else None
    tokens, entries = reference(star.spec, star.base, ids, g, body["max_tokens"], star.tok.eos_ids, logprobs)
    if tokens[-1] in star.tok.eos_ids:
        tokens, entries = tokens[:-1], entries[:-1]
    return star.tok.decode(tokens), entries


def test_json_schema_answers_validate_greedy_and_sampled(client, star):
    for schema in SCHEMAS:
        out = client.chat.completions.create(model="json", messages=ASK, max_tokens=96, temperature=0,
                                             response_format=fmt(schema))
        text = out.choices[0].message.content
        jsonschema.validate(json.loads(text), schema)
        assert out.choices[0].finish_reason == "stop"
        body = {"model": "json", "messages": ASK, "max_tokens": 96}
        assert text == expected(star, body, schema)[0]
        for seed in (1, 2):
            out = client.chat.completions.create(model="json", messages=ASK, max_tokens=96, temperature=1.0,
                                                 seed=seed, response_format=fmt(schema))
            jsonschema.validate(json.loads(out.choices[0].message.content), schema)


@pytest.mark.parametrize("i", range(10))
def test_every_answer_to_the_fuzzed_schemas_validates(client, i):
    """The bounded schemas a target's endpoint is fuzzed with (tests/system/test_structured_output.py),
    greedy and sampled, through SUN."""
    from test_structured_output import fuzzed_schemas      # the one generator (tests/system is on the path)
    schema = fuzzed_schemas()[i]
    for kw in ({"temperature": 0}, {"temperature": 1.0, "seed": i}):
        out = client.chat.completions.create(model="json", messages=ASK, max_tokens=300, response_format=fmt(schema),
                                             **kw)
        assert out.choices[0].finish_reason == "stop", (schema, out.choices[0])
        jsonschema.validate(json.loads(out.choices[0].message.content), schema)


def test_a_forced_tool_call_through_a_sun_task(client):
    for choice in ("required", {"type": "function", "function": {"name": "city"}}):
        out = client.chat.completions.create(model="tools", messages=[{"role": "user", "content": "add 2 and 3"}],
                                             tools=TOOLS, tool_choice=choice, max_tokens=120, temperature=0)
        c = out.choices[0]
        assert c.finish_reason == "tool_calls" and c.message.tool_calls, c
        for call in c.message.tool_calls:
            assert call.type == "function" and call.id.startswith("call_")
            jsonschema.validate(json.loads(call.function.arguments), ARGS[call.function.name])
        if isinstance(choice, dict):
            assert [x.function.name for x in c.message.tool_calls] == ["city"]


def test_a_streamed_tool_call_is_the_whole_answer(client):
    kw = dict(model="tools", messages=[{"role": "user", "content": "add 1 and 1"}], tools=TOOLS,
              tool_choice={"type": "function", "function": {"name": "add"}}, max_tokens=120, temperature=0)
    whole = client.chat.completions.create(**kw).choices[0]
    calls, finish = {}, None
    for chunk in client.chat.completions.create(stream=True, **kw):
        if not chunk.choices:
            continue
        d = chunk.choices[0].delta
        finish = chunk.choices[0].finish_reason or finish
        for tc in d.tool_calls or ():
            c = calls.setdefault(tc.index, {"id": None, "name": "", "arguments": ""})
            if tc.id:                                      # id and name come first, the arguments after
                assert not c["arguments"]
                c["id"], c["name"] = tc.id, tc.function.name
            c["arguments"] += tc.function.arguments or ""
    assert finish == "tool_calls"
    got = [(c["name"], json.loads(c["arguments"])) for _, c in sorted(calls.items())]
    assert got == [(x.function.name, json.loads(x.function.arguments)) for x in whole.message.tool_calls]


def test_logprobs_come_from_the_workers_masked_rows(client, star):
    body = {"model": "json", "messages": ASK, "max_tokens": 96}
    for schema in (PERSON, None):
        kw = {"response_format": fmt(schema)} if schema else {}
        out = client.chat.completions.create(temperature=0, logprobs=True, top_logprobs=3, **body, **kw)
        content = out.choices[0].logprobs.content
        text, entries = expected(star, body, schema, logprobs=3)
        assert out.choices[0].message.content == text and len(content) == len(entries)
        assert out.usage.completion_tokens == len(entries)            # the end token not counted, as a target
        for got, (lp, alts) in zip(content, entries):
            assert got.logprob == pytest.approx(lp, abs=1e-9) and got.top_logprobs[0].logprob == pytest.approx(lp)
            assert [a.logprob for a in got.top_logprobs] == pytest.approx([a for _, a in alts], abs=1e-9)
    comp = client.completions.create(model="plain", prompt="abc", max_tokens=8, temperature=0, logprobs=2)
    lp = comp.choices[0].logprobs
    assert len(lp.tokens) == comp.usage.completion_tokens == 8 and all(len(t) <= 2 for t in lp.top_logprobs)
    assert all(x <= 0 for x in lp.token_logprobs) and "".join(lp.tokens) == comp.choices[0].text


def test_grammars_and_none_at_once_each_keep_their_answer(client, star):
    jobs = [PERSON, None, POINT, None, PERSON, POINT]
    out = {}

    def ask(i, schema):
        kw = {"response_format": fmt(schema)} if schema else {}
        out[i] = client.chat.completions.create(model="json", messages=ASK + [{"role": "user", "content": str(i)}],
                                                max_tokens=96, temperature=0, **kw).choices[0].message.content
    threads = [threading.Thread(target=ask, args=job) for job in enumerate(jobs)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    for i, schema in enumerate(jobs):
        body = {"model": "json", "messages": ASK + [{"role": "user", "content": str(i)}], "max_tokens": 96}
        assert out[i] == expected(star, body, schema)[0], (i, schema)


def test_grammars_go_only_to_workers_that_follow_them(client, star):
    routed = star.hub.router.snapshot()
    assert routed["workers"]["dec-g"]["grammars"] and not routed["workers"]["dec-n"]["grammars"]
    dec_n = star.nodes["dec-n"].stats["admitted"]
    for _ in range(3):
        client.chat.completions.create(model="json", messages=ASK, max_tokens=96, temperature=0,
                                       response_format=fmt(POINT))
    assert star.nodes["dec-n"].stats["admitted"] == dec_n            # every one went to dec-g
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="plain", messages=ASK, max_tokens=8, response_format=fmt(POINT))
    assert "--tokenizer" in e.value.body["message"] and "plain" in e.value.body["message"]
    out = client.chat.completions.create(model="plain", messages=ASK, max_tokens=8, temperature=0)
    assert out.usage.completion_tokens == 8                            # and it keeps serving


def test_console_scripts_serve_grammars_with_their_tokenizer(mosquitto, tmp_path):
    """As a user starts it: `edge-hub serve --sun-http-port --sun-tokenizer TOK`, `edge-agent run --role
    decoder|prefill --module DIR --tokenizer TOK` (real processes, torch): a json_schema answer
    validates and carries logprobs, a forced tool call is valid; the workers say they follow grammars."""
    from edge.model.tokenizer import Tokenizer
    from harness.console_scripts import BIN, Procs, sun_dirs
    from harness.tiny_hf import tokenizer_dir
    from server.broker import find_free_port
    dec_dir, maths_dir = sun_dirs(tmp_path)
    tokenizer_dir(tmp_path / "tok0")
    tok = Tokenizer.from_hf_dir(tmp_path / "tok0")
    tok.chat_template = TOOL_TEMPLATE
    tok.save(tmp_path / "tok")
    key = tmp_path / "ctl.key"
    key.write_bytes(KEY)
    port, ps = find_free_port(), Procs(tmp_path)
    common = ["--broker", mosquitto.url, "--ctl-key-file", key, "--threads", "1"]
    try:
        ps.start("hub", BIN / "edge-hub", "serve", "--hub-id", f"hp-{port}", "--sun-http-port", port, "--sun-tokenizer",
                 tmp_path / "tok", *common)
        for role, module in (("decoder", dec_dir), ("prefill", maths_dir)):
            ps.start(role, BIN / "edge-agent", "run", "--role", role, "--module", module, "--tokenizer", tmp_path / "tok",
                     "--client-id", f"{role}-{port}", *common)
        for name in ("hub", "decoder", "prefill"):
            ps.wait_for(name, "serving on" if name == "hub" else "up at", 120)
        assert "request grammars followed" in ps.err("decoder") and "request grammars followed" in ps.err("prefill")
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=60)
        # the router probes it; the broker is shared with the worker's earlier tests, whose workers it may list too
        assert wait_until(lambda: "maths" in [m.id for m in client.models.list().data], 180)
        out = client.chat.completions.create(model="maths", messages=ASK, max_tokens=96, temperature=0,
                                             response_format=fmt(PERSON), logprobs=True, top_logprobs=2)
        jsonschema.validate(json.loads(out.choices[0].message.content), PERSON)
        assert len(out.choices[0].logprobs.content) == out.usage.completion_tokens
        call = client.chat.completions.create(model="maths", messages=ASK, tools=[CITY], tool_choice="required",
                                              parallel_tool_calls=False, max_tokens=200, temperature=0).choices[0]
        assert call.finish_reason == "tool_calls"
        jsonschema.validate(json.loads(call.message.tool_calls[0].function.arguments),
                            ARGS[call.message.tool_calls[0].function.name])
    finally:
        for name in ("prefill", "decoder", "hub"):
            if name in ps.procs:
                ps.stop(name)
        ps.close()
