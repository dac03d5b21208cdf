"""Acceptance: a real star serving a real model, called the way a user calls it (#44 item 6).

One star for the whole module, as the console scripts run it: Mosquitto (the session fixture),
`edge-hub serve --draft-model qwen2.5-coder-0.5b` (the hub's own draft service) and `edge-agent run
--role target -m qwen2.5-coder-0.5b --http-port ...` (its OpenAI endpoint), each on llama.cpp with
one thread and --max-len 2048, the target with its prompt cache on (--prompt-cache 4; --parallel 2
where the agent has that option). The official openai client talks to the endpoint, greedy, few
tokens. What an agent needs from it:

(a) tool_choice auto: get_weather called with JSON arguments naming Paris, finish_reason tool_calls;
(b) tool_choice required: a valid call (not a grammar loop cut at max_tokens); a named function is
    the one called, even a second tool the question does not ask for;
(c) the same streamed: the call's id and name first, then arguments fragments that add up to JSON
    of the function's schema, finish_reason tool_calls;
(d) an agent loop: the assistant's tool_calls message and a tool message with the result back in,
    a plain text answer that mentions the result (18 degrees);
(e) response_format json_schema: content that validates against the schema (jsonschema), its keys
    and punctuation taken without a target forward (jump-forward: the answer's timings.forced_n),
    as is a named tool_choice's fixed frame;
(f) a conversation's second turn reuses the first's prompt: usage.prompt_tokens_details.cached_tokens;
    also after more conversations than the 4 held slots let it go (saved to host memory, restored);
(g) two requests at once (one free, one held to a json_schema) both complete, each with its own
    correct answer (no overlap asserted);
(h) back-to-back pairs of requests at once, at the client limit of 2 (the hub's --max-sessions 4, half
    for one client, = --parallel 2): no join refused for sessions whose byes are still on their way;
and the drafts came from the hub's draft service (its stats line counts them).

The 0.5B answering a tool result: after its own call and the tool's answer it writes the same call
again (greedy, on plain llama.cpp too, and the 1.5B likewise), whatever the question's wording or
the result's shape; a system message after the tool result asking for the answer in plain words
gets it, so (d) sends one, as agent frameworks do.

The model is fetched by `make test` (make test-models); without the file the module skips.
"""
from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import openai
import pytest

from harness.agent_asks import ASK, WEATHER, city_schema, fetched_or_skip, json_ask, tool_ask
from harness.console_scripts import BIN, Procs
from harness.waiting import wait_until

MODEL = "qwen2.5-coder-0.5b"
fetched_or_skip(MODEL)

# one star for the module: under pytest-xdist (--dist loadgroup) its tests stay on one worker (each
# test also stands alone, as a worker given only some of them starts a star of its own)
pytestmark = [pytest.mark.slow, pytest.mark.real_model, pytest.mark.llamacpp, pytest.mark.broker,
              pytest.mark.xdist_group("real_agent_star")]

TIME = {"type": "function", "function": {
    "name": "get_time", "description": "Get the local time in a city",
    "parameters": {"type": "object", "required": ["city"], "properties": {"city": {"type": "string"}}}}}
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
TOOL_ASK = tool_ask(MODEL)
CITY = city_schema()
JSON_ASK = json_ask(MODEL, CITY)


def _agent_has(option: str) -> bool:
    from edge.cli.agent_run import run
    return any(option in p.opts for p in run.params)


@pytest.fixture(scope="module")
def star(mosquitto, tmp_path_factory):
    """(openai client, Procs): the hub and the target processes on the session's Mosquitto."""
    from server.broker import find_free_port
    ps = Procs(tmp_path_factory.mktemp("real_agent_star"))
    port = find_free_port()
    common = ["--broker", mosquitto.url, "--threads", "1", "--max-len", "2048"]
    parallel = ["--parallel", "2"] if _agent_has("--parallel") else []
    try:                              # both load at once; a target up first joins at its first request
        ps.start("hub", BIN / "edge-hub", "serve", "--draft-model", MODEL, "--stats-every", "0.5",
                 "--max-sessions", "4", *common)
        ps.start("target", BIN / "edge-agent", "run", "--role", "target", "-m", MODEL, "--client-id", "acceptance",
                 "--http-port", port, "--prompt-cache", "4", *parallel, *common)
        ps.wait_for("hub", "serving on", 120)
        ps.wait_for("target", "OpenAI endpoint on", 120)
        yield openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0,
                            timeout=120), ps
    finally:
        for name in ("target", "hub"):
            if name in ps.procs:
                ps.stop(name)
        ps.close()


@pytest.fixture(scope="module")
def client(star):
    return star[0]


def raw(r) -> str:
    return r.model_dump_json(exclude_none=True)


def weather_call(r, name: str = "get_weather"):
    """The reply is tool calls only, each `name` with JSON arguments of its schema naming Paris."""
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls", raw(r)
    assert choice.message.content is None and choice.message.tool_calls, raw(r)
    for c in choice.message.tool_calls:
        assert c.type == "function" and c.id and c.function.name == name, raw(r)
        args = json.loads(c.function.arguments)
        jsonschema.validate(args, SCHEMAS[name])
        assert args["city"] == "Paris", raw(r)
    return choice.message


def city_json(r):
    """The reply is JSON valid against CITY."""
    choice = r.choices[0]
    assert choice.finish_reason == "stop" and not choice.message.tool_calls, raw(r)
    doc = json.loads(choice.message.content)
    jsonschema.validate(doc, CITY)
    assert doc["city"] == "Paris", raw(r)
    return doc


@pytest.fixture(scope="module")
def auto_call(client):
    """(a)'s answer, also the first step of (d)'s agent loop."""
    return client.chat.completions.create(**TOOL_ASK)


def test_a_tool_call_with_tool_choice_auto(auto_call):
    weather_call(auto_call)


@pytest.mark.parametrize("choice", ["required", "named"])
def test_a_forced_tool_call_is_a_valid_call(client, choice):
    if choice == "required":
        r = client.chat.completions.create(**TOOL_ASK, tool_choice="required")
        weather_call(r)
    else:                                       # the named one, not the one the question asks for
        r = client.chat.completions.create(**{**TOOL_ASK, "tools": [WEATHER, TIME]},
                                           tool_choice={"type": "function", "function": {"name": "get_time"}})
        weather_call(r, "get_time")
        # <tool_call>, {"name": "get_time", ...: forced, no forward of their own (how many varies: those
        # inside a draft the target accepted count as drafted)
        assert r.model_extra["timings"]["forced_n"] >= 1, raw(r)
    assert r.usage.completion_tokens < TOOL_ASK["max_tokens"], raw(r)     # ended by its grammar, no loop


@pytest.mark.parametrize("choice", ["auto", "required"])
def test_a_streamed_tool_call(client, choice):
    chunks = list(client.chat.completions.create(**TOOL_ASK, **({"tool_choice": choice} if choice != "auto" else {}),
                                                 stream=True, stream_options={"include_usage": True}))
    seen = "\n".join(c.model_dump_json(exclude_none=True) for c in chunks)
    content, calls, finish, fragments = "", {}, None, 0
    for chunk in chunks:
        for ch in chunk.choices:
            finish = ch.finish_reason or finish
            content += ch.delta.content or ""
            for d in ch.delta.tool_calls or ():
                if d.index not in calls:                 # the call's first delta: id, type and name
                    assert d.id and d.type == "function" and d.function.name == "get_weather", seen
                    assert not d.function.arguments, seen
                    calls[d.index] = ""
                else:                                    # then its arguments, in fragments
                    assert d.id is None and d.function.name is None, seen
                    calls[d.index] += d.function.arguments
                    fragments += 1
    assert finish == "tool_calls" and content == "" and calls and fragments >= 1, seen
    for args in calls.values():
        jsonschema.validate(json.loads(args), WEATHER["function"]["parameters"])
        assert json.loads(args)["city"] == "Paris", seen
    if choice == "required":                             # a <tool_call> frame streams as written
        assert fragments > 1, seen
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens > 0, seen


def test_an_agent_loop_answers_with_the_tool_result(client, auto_call):
    call = weather_call(auto_call)
    result = {"city": "Paris", "temperature": 18, "unit": "celsius", "sky": "sunny"}
    messages = ASK + [call.model_dump(exclude_none=True),
                      {"role": "tool", "tool_call_id": call.tool_calls[0].id, "content": json.dumps(result)},
                      {"role": "system", "content": "Now answer the user's question in plain English."}]
    r = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER], temperature=0, max_tokens=40)
    choice = r.choices[0]
    assert choice.finish_reason == "stop" and not choice.message.tool_calls, raw(r)
    text = choice.message.content
    assert re.search(r"\b18\b", text) and "get_weather" not in text and "{" not in text, raw(r)


def test_response_format_json_schema(client):
    r = client.chat.completions.create(**JSON_ASK)
    city_json(r)
    t = r.model_extra["timings"]        # the keys, their quotes and colons: forced, no forward of their own
    # how many: those the hub's draft already proposed inside an accepted round count as drafted (a
    # fresh clone's run took 5 where the in-tree runs took 6 or more); that some were taken is the point
    assert t["forced_n"] >= 1 and t["verify_n"] <= t["predicted_n"] - t["forced_n"] + 1, raw(r)


def test_the_second_turn_reuses_the_first_turns_prompt(client):
    conv = [{"role": "user", "content": "Name one prime number greater than 10. Answer in one short sentence."}]
    one = client.chat.completions.create(model=MODEL, messages=conv, temperature=0, max_tokens=20)
    reply = one.choices[0].message.content
    assert reply, raw(one)
    conv += [{"role": "assistant", "content": reply}, {"role": "user", "content": "And one greater than 20?"}]
    two = client.chat.completions.create(model=MODEL, messages=conv, temperature=0, max_tokens=20)
    assert two.choices[0].message.content, raw(two)
    cached = two.usage.prompt_tokens_details.cached_tokens
    # the whole first prompt (the second one starts with it), never the whole second one
    assert one.usage.prompt_tokens <= cached < two.usage.prompt_tokens, (raw(one), raw(two))


def test_a_conversation_the_held_slots_let_go_comes_back_from_host_memory(client):
    code = "\n".join(f"def add_{i}(x):\n    return x + {i}" for i in range(30))
    conv = [{"role": "system", "content": "You review Python modules. Answer with a function name only."},
            {"role": "user", "content": f"{code}\n\nWhich function adds 7?"}]
    one = client.chat.completions.create(model=MODEL, messages=conv, temperature=0, max_tokens=8)
    for i in range(6):              # more conversations than the target's 4 held slots, sharing < 16 tokens
        client.chat.completions.create(model=MODEL, temperature=0, max_tokens=2, messages=[   # with any other
            {"role": "system", "content": f"{i} is your number."}, {"role": "user", "content": "Say it in French."}])
    conv += [{"role": "assistant", "content": one.choices[0].message.content},
             {"role": "user", "content": "And which adds 9?"}]
    two = client.chat.completions.create(model=MODEL, messages=conv, temperature=0, max_tokens=8)
    assert two.choices[0].message.content, raw(two)
    assert one.usage.prompt_tokens <= two.usage.prompt_tokens_details.cached_tokens < two.usage.prompt_tokens, \
        (raw(one), raw(two))


def test_two_requests_at_once_both_complete(client):
    """One free and one grammar-held (json_schema) request at once: each gets its own answer."""
    capital = {"type": "object", "additionalProperties": False, "required": ["capital"],
               "properties": {"capital": {"type": "string"}}}
    ask = dict(model=MODEL, temperature=0, max_tokens=16)
    with ThreadPoolExecutor(2) as pool:
        free = pool.submit(client.chat.completions.create, **ask, messages=[
            {"role": "user", "content": "What is 12+30? Answer with just the number."}])
        held = pool.submit(client.chat.completions.create, **ask, messages=[
            {"role": "user", "content": "What is the capital of Italy? Answer in JSON."}],
            response_format={"type": "json_schema", "json_schema": {"name": "capital", "schema": capital}})
        free, held = free.result(timeout=300), held.result(timeout=300)
    assert free.choices[0].finish_reason == "stop" and free.choices[0].message.content.strip() == "42", raw(free)
    assert held.choices[0].finish_reason == "stop", raw(held)
    doc = json.loads(held.choices[0].message.content)
    jsonschema.validate(doc, capital)
    assert doc["capital"] == "Rome", raw(held)


def test_back_to_back_requests_at_once_keep_their_sessions(star):
    """(h) #44: a join names the sessions its client ended, so the hub does not count them while their
    byes are still at the draft service; a refused join would decode alone (lossless) and say so."""
    client, ps = star
    ask = dict(model=MODEL, temperature=0, max_tokens=6)
    for wave in range(3):
        with ThreadPoolExecutor(2) as pool:
            asks = [pool.submit(client.chat.completions.create, **ask, messages=[
                {"role": "user", "content": f"Count from {k} to {k + 4}."}]) for k in (2 * wave, 2 * wave + 1)]
            for r in asks:
                assert r.result(timeout=300).choices[0].message.content
    assert "refused the session" not in ps.err("target"), ps.err("target")


def test_the_drafts_came_from_the_hubs_draft_service(star):
    client, ps = star
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Say hello."}],
                                       temperature=0, max_tokens=6)
    assert r.choices[0].message.content, raw(r)

    def drafted() -> int:                       # the hub's stats line: its draft service's requests
        counts = re.findall(r" requests=(\d+) ", ps.err("hub"))
        return int(counts[-1]) if counts else 0
    assert wait_until(lambda: drafted() > 0, 10), ps.err("hub") + ps.err("target")
