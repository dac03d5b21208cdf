"""response_format on a target's OpenAI endpoint (edge/api/structured.py), through the star.

A StarSD target (float64 tiny llama, byte-level BPE with an end token) behind the endpoint, its
hub's draft service proposing under the request's grammar on an in-memory bus. Every answer to
a fuzzed set of bounded JSON schemas (llguidance compiles them) parses and validates with
`jsonschema`, greedy and sampled; the greedy answer is exactly the target's plain constrained
text; json_object gives a JSON object; a malformed schema, a schema whose grammar is over the cap
and a malformed response_format are 400s naming response_format, and the endpoint keeps serving.
"""
import json
import random

import pytest

pytest.importorskip("llguidance")
jsonschema = pytest.importorskip("jsonschema")

from edge.api.openai_http import OpenAIServer  # noqa: E402
from edge.speculative.generate import generate_plain  # noqa: E402
from edge.speculative.grammar import Grammar, grammar_from_json_schema, grammar_tokenizer  # noqa: E402
from edge.speculative.sampling import GREEDY  # noqa: E402
from edge.star.draft_service import DraftLimits, DraftService  # noqa: E402
from edge.star.hub_client import HubClient  # noqa: E402
from edge.star.target import StarTarget  # noqa: E402
from edge.wire.memory_link import MemoryBus, MemoryLink  # noqa: E402
from server.hub import Hub  # noqa: E402

from harness.grammars import bpe_tokenizer, tiny_pair  # noqa: E402
from harness.http_endpoints import TEMPLATE, post  # noqa: E402

CHAT = "/v1/chat/completions"
HI = [{"role": "user", "content": "json please"}]


@pytest.fixture(scope="module")
def endpoint(tmp_path_factory):
    tok = bpe_tokenizer(tmp_path_factory.mktemp("tok") / "t")
    tok.chat_template = TEMPLATE
    target, draft = tiny_pair(tok.vocab_size, max_len=512)
    bus, fp = MemoryBus(), tok.fingerprint()
    svc = DraftService(draft, DraftLimits(), name="hub-draft", grammar_tokenizer=grammar_tokenizer(tok))
    hub = Hub(link=MemoryLink(bus, "hub"), draft_core=svc, tokenizer_fp=fp, status_every=60.0).start()
    star = StarTarget(target, HubClient(MemoryLink(bus, "dev"), "dev", fp, tok.vocab_size), gamma=3)
    server = OpenAIServer(star.generate, tok, "tiny", port=0, context=512).start()
    yield server, target, tok, svc
    server.stop()
    hub.stop()


def _leaf(rng):
    return rng.choice([
        {"type": "boolean"},
        {"enum": rng.sample(["red", "green", 7, None, True, "x y"], 3)},
        {"type": "string", "maxLength": rng.randint(0, 8)},
        {"type": "integer", "minimum": rng.randint(-50, 0), "maximum": rng.randint(1, 999)},
        {"const": "fixed"},
        {"type": "null"},
    ])


def _schema(rng, depth=0):
    kind = rng.random()
    if depth < 2 and kind < 0.45:
        names = rng.sample(["id", "name", "ok", "tags", "pos", "meta"], rng.randint(1, 4))
        props = {n: _schema(rng, depth + 1) for n in names}
        return {"type": "object", "properties": props, "required": rng.sample(names, rng.randint(0, len(names))),
                "additionalProperties": False}
    if depth < 2 and kind < 0.65:
        return {"type": "array", "items": _schema(rng, depth + 1), "minItems": rng.randint(0, 1),
                "maxItems": rng.randint(1, 3)}
    if depth < 2 and kind < 0.75:
        return {"anyOf": [_leaf(rng), _leaf(rng)]}
    return _leaf(rng)


def fuzzed_schemas(n=10, seed=36):
    rng = random.Random(seed)
    out = [{"type": "object", "properties": {"a": _schema(rng, 1)}, "required": ["a"],
            "additionalProperties": False}]
    while len(out) < n:
        out.append(_schema(rng))
    return out


def ask(server, schema, **kw):
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}}
    return post(server, CHAT, {"messages": HI, "max_tokens": 300, "response_format": fmt, **kw})


@pytest.mark.parametrize("i, schema", list(enumerate(fuzzed_schemas())))
def test_every_answer_validates_against_its_schema(endpoint, i, schema):
    server, target, tok, _ = endpoint
    for kw in ({"temperature": 0}, {"temperature": 1.0, "seed": i}):
        r = ask(server, schema, **kw)
        choice = r["choices"][0]
        assert choice["finish_reason"] == "stop", (schema, choice)
        jsonschema.validate(json.loads(choice["message"]["content"]), schema)


def test_greedy_answer_is_the_plain_constrained_text(endpoint):
    server, target, tok, svc = endpoint
    schema = fuzzed_schemas()[0]
    got = ask(server, schema, temperature=0)["choices"][0]["message"]["content"]
    grammar = Grammar(grammar_from_json_schema(schema), grammar_tokenizer(tok))
    ids = tok.encode(tok.apply_chat_template(HI))
    want = generate_plain(target, ids, 300, GREEDY, stop_ids=tok.eos_ids, grammar=grammar)
    assert got == tok.decode(want.tokens, skip_special=True)
    assert svc.stats.snapshot()["counters"].get("grammars_compiled", 0) >= 1


def test_logprobs_under_a_grammar_name_only_allowed_tokens(endpoint):
    server = endpoint[0]
    r = post(server, CHAT, {"messages": HI, "max_tokens": 60, "temperature": 0, "logprobs": True,
                            "top_logprobs": 5, "response_format": {"type": "json_schema", "json_schema": {
                                "name": "b", "schema": {"type": "boolean"}}}})
    entries = r["choices"][0]["logprobs"]["content"]
    assert "".join(e["token"] for e in entries) == r["choices"][0]["message"]["content"]
    first = entries[0]                     # "true" or "false": only t or f may start it
    assert 1 <= len(first["top_logprobs"]) <= 2 and all(a["logprob"] > -1e9 for a in first["top_logprobs"])
    assert abs(sum(2.718281828 ** a["logprob"] for a in first["top_logprobs"]) - 1.0) < 1e-6


def test_json_object_is_a_json_object(endpoint):
    server = endpoint[0]
    for seed in range(3):
        r = post(server, CHAT, {"messages": HI, "max_tokens": 300, "temperature": 1.0, "seed": seed,
                                "response_format": {"type": "json_object"}})
        choice = r["choices"][0]
        if choice["finish_reason"] == "stop":
            assert isinstance(json.loads(choice["message"]["content"]), dict)
        else:                                  # cut by max_tokens: still the start of an object
            assert choice["message"]["content"].startswith("{")


def test_the_sun_hub_says_why_its_base_cannot_follow_a_grammar_or_tools():
    """The SUN hub honours them (tests/system/test_sun_agent_api.py); this base's byte tokenizer has no
    end token (a grammar could never end) and its template renders no tools: 400s naming why."""
    from harness.http_endpoints import sun_http_endpoint
    gen = sun_http_endpoint(["maths"])
    server = next(gen)[0]
    try:
        tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
        for extra, param, why in (({"response_format": {"type": "json_object"}}, "response_format", "end-of-generation"),
                                  ({"tools": tools}, "tools", "no tool support"),
                                  ({"tool_choice": "required"}, "tool_choice", "needs 'tools'")):
            code, err = _status(server, {"model": "maths", "messages": HI, "max_tokens": 2, **extra})
            assert code == 400 and err["param"] == param and why in err["message"], err
    finally:
        gen.close()


def _status(server, body):
    import urllib.error
    try:
        post(server, CHAT, body)
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())["error"]
    return 200, None


@pytest.mark.parametrize("fmt, why", [
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "no-such-type"}}}, "refused"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"enum": [f"{i:05d}" + "x" * 900
                                                                              for i in range(100)]}}},
     "over the limit"),
    ({"type": "json_schema", "json_schema": "not an object"}, "json_schema"),
    ({"type": "yaml"}, "text, json_object or json_schema"),
    ("json", "must be an object"),
])
def test_bad_formats_are_400s_and_the_endpoint_keeps_serving(endpoint, fmt, why):
    server = endpoint[0]
    code, err = _status(server, {"messages": HI, "max_tokens": 4, "response_format": fmt})
    assert code == 400 and err["param"] == "response_format" and why in err["message"], err
    ok = post(server, CHAT, {"messages": HI, "max_tokens": 4, "temperature": 0})
    assert ok["choices"][0]["finish_reason"] in ("stop", "length")


def test_forced_tokens_are_jumped_and_reported(endpoint):
    """Keys and punctuation the schema forces come without a target call: the answer's `timings`
    (llama-server's names, plus forced_n and verify_n) count them, their logprob is 0.0 with no
    alternative, and a stream's last chunk carries the same timings."""
    server = endpoint[0]
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 4}, "ok": {"type": "boolean"}},
              "required": ["name", "ok"], "additionalProperties": False}
    r = ask(server, schema, temperature=0, logprobs=True, top_logprobs=2)
    t = r["timings"]
    assert t["forced_n"] >= 4 and t["predicted_n"] == r["usage"]["completion_tokens"], t    # {"name": ... "ok":
    assert t["verify_n"] >= 1 and t["prompt_n"] + t["cache_n"] == r["usage"]["prompt_tokens"], t
    forced = [e for e in r["choices"][0]["logprobs"]["content"] if e["logprob"] == 0.0]
    assert len(forced) >= 4 and all(len(e["top_logprobs"]) == 1 for e in forced), forced
    raw = post(server, CHAT, {"messages": HI, "max_tokens": 300, "temperature": 0, "stream": True,
                              "response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": schema}}},
               raw=True)
    chunks = [json.loads(line[6:]) for line in raw.splitlines() if line.startswith("data: {")]
    last = [c for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert len(last) == 1 and last[0]["timings"]["forced_n"] == t["forced_n"], last
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"]) == \
        r["choices"][0]["message"]["content"]


HOSTILE = {     # the issue's list (#44): each answered or refused, and the endpoint keeps serving
    "catastrophic regex": {"type": "string", "pattern": "^(a+)+(b+)+(a|aa)*c$"},
    "300-deep nesting": json.loads('{"type": "array", "items": ' * 300 + '{"type": "integer"}' + "}" * 300),
    "20,000-value enum": {"enum": [f"value-{i}" for i in range(20_000)]},
    "minItems 100000": {"type": "array", "items": {"const": 1}, "minItems": 100_000},
    "bad $ref": {"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}},
}


@pytest.mark.parametrize("name", list(HOSTILE))
def test_hostile_schemas_are_answered_or_refused(endpoint, name):
    """A forced stretch as long as the answer (minItems: "[1, 1, ...") is jump-forwarded up to
    max_tokens and no further; the others compile or are a 400 naming response_format."""
    import urllib.error
    server = endpoint[0]
    try:
        r = ask(server, HOSTILE[name], temperature=0, max_tokens=40)
    except urllib.error.HTTPError as e:
        err = json.loads(e.read())["error"]
        assert e.code == 400 and err["param"] == "response_format", err
    else:
        choice = r["choices"][0]
        assert choice["finish_reason"] in ("stop", "length"), choice
        assert r["usage"]["completion_tokens"] <= 40, r["usage"]
    assert ask(server, {"type": "boolean"}, temperature=0)["choices"][0]["message"]["content"] in ("true", "false")
