"""Tool calling on a target's OpenAI endpoint (edge/api/tools.py), through the star.

A StarSD target (float64 tiny llama, byte-level BPE) behind the endpoint, with a small chat
template that renders tools the Qwen2.5 way. tool_choice required / a named function constrain
the reply to calls whose arguments validate against the function's schema (jsonschema), with
finish_reason tool_calls, streamed too (the openai client); parallel_tool_calls false gives one
call; an agent loop sends the call's answer back as a tool message; a template without tool
support is a 400 naming tools and the endpoint keeps serving. The real Qwen2.5 GGUF template
renders the tools and an assistant's calls as the parser reads them back.
"""
import glob
import json
import pathlib

import pytest

pytest.importorskip("llguidance")
jsonschema = pytest.importorskip("jsonschema")
openai = pytest.importorskip("openai")

from edge.api.openai_http import OpenAIServer  # noqa: E402
from edge.api.tools import parse_calls, template_messages  # noqa: E402
from edge.speculative.grammar import grammar_tokenizer  # noqa: E402
from edge.star.draft_service import DraftLimits, DraftService  # noqa: E402
from edge.star.hub_client import HubClient  # noqa: E402
from edge.star.target import StarTarget  # noqa: E402
from edge.wire.memory_link import MemoryBus, MemoryLink  # noqa: E402
from server.hub import Hub  # noqa: E402

from harness.grammars import bpe_tokenizer, tiny_pair  # noqa: E402
from harness.http_endpoints import TEMPLATE  # noqa: E402

TOOL_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n<tools>{% for t in tools %}\n{{ t | tojson }}{% endfor %}\n</tools>"
    "<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.tool_calls %}{% for c in m.tool_calls %}"
    "<tool_call>\n{\"name\": \"{{ c.function.name }}\", \"arguments\": {{ c.function.arguments | tojson }}}\n"
    "</tool_call>{% endfor %}{% else %}{{ m.content }}{% endif %}<|im_end|>\n{% endfor %}<|im_start|>assistant\n")
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "weather in a city",
                                            "parameters": {"type": "object", "required": ["city"],
                                                           "additionalProperties": False,
                                                           "properties": {"city": {"type": "string", "maxLength": 8},
                                                                          "days": {"type": "integer", "minimum": 1,
                                                                                   "maximum": 7}}}}}
ADD = {"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "required": ["a", "b"], "additionalProperties": False,
    "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                   "b": {"type": "integer", "minimum": 0, "maximum": 99}}}}}
TOOLS = [WEATHER, ADD]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "weather in Rome?"}]


def _endpoint(tok):
    target, draft = tiny_pair(tok.vocab_size, max_len=1024)
    bus, fp = MemoryBus(), tok.fingerprint()
    svc = DraftService(draft, DraftLimits(), name="hub-draft", grammar_tokenizer=grammar_tokenizer(tok))
    hub = Hub(link=MemoryLink(bus, "hub"), draft_core=svc, tokenizer_fp=fp, status_every=60.0).start()
    star = StarTarget(target, HubClient(MemoryLink(bus, "dev"), "dev", fp, tok.vocab_size), gamma=3)
    return hub, OpenAIServer(star.generate, tok, "tiny", port=0, context=1024).start()


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    tok = bpe_tokenizer(tmp_path_factory.mktemp("tok") / "t")
    tok.chat_template = TOOL_TEMPLATE
    hub, server = _endpoint(tok)
    yield openai.OpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="none", max_retries=0)
    server.stop()
    hub.stop()


def check_calls(choice, allowed):
    assert choice.finish_reason == "tool_calls", choice
    calls = choice.message.tool_calls
    assert calls, choice
    for c in calls:
        assert c.type == "function" and c.id.startswith("call_") and c.function.name in allowed
        jsonschema.validate(json.loads(c.function.arguments), SCHEMAS[c.function.name])
    return calls


@pytest.mark.parametrize("kw", [{"temperature": 0}, {"temperature": 1.0, "seed": 1}, {"temperature": 1.0, "seed": 2}])
def test_required_tool_choice_gives_valid_calls(client, kw):
    r = client.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS, tool_choice="required",
                                       max_tokens=400, **kw)
    check_calls(r.choices[0], {"get_weather", "add"})


def test_a_named_function_is_the_one_called_and_parallel_false_gives_one_call(client):
    r = client.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS, max_tokens=400, temperature=0,
                                       tool_choice={"type": "function", "function": {"name": "add"}},
                                       parallel_tool_calls=False)
    (call,) = check_calls(r.choices[0], {"add"})
    assert call.function.name == "add"


def accumulate(chunks):
    """What an OpenAI client rebuilds from streamed tool-call deltas: per index the first delta's id,
    type and name, then the arguments concatenated; and how many argument deltas each call had."""
    calls, pieces, finish = {}, {}, None
    for chunk in chunks:
        for ch in chunk.choices:
            finish = ch.finish_reason or finish
            for d in ch.delta.tool_calls or ():
                if d.index not in calls:             # the call's first delta names it, arguments still ""
                    assert d.id and d.id.startswith("call_") and d.type == "function" and d.function.name
                    assert d.function.arguments == ""
                    calls[d.index] = {"name": d.function.name, "arguments": ""}
                else:                                 # then only arguments, as they are written
                    assert d.id is None and d.function.name is None
                    calls[d.index]["arguments"] += d.function.arguments
                    pieces[d.index] = pieces.get(d.index, 0) + 1
    return [calls[i] for i in sorted(calls)], [pieces.get(i, 0) for i in sorted(calls)], finish


def test_streamed_tool_calls_are_the_same_calls(client):
    kw = dict(model="tiny", messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=400, temperature=0)
    whole = client.chat.completions.create(**kw).choices[0]
    calls, pieces, finish = accumulate(client.chat.completions.create(stream=True, **kw))
    assert finish == "tool_calls"
    assert calls == [{"name": c.function.name, "arguments": c.function.arguments} for c in whole.message.tool_calls]
    assert all(n > 1 for n in pieces), pieces     # the arguments streamed token by token, not whole


def scripted_server(tok, reply: str):
    """An endpoint whose generation writes `reply`, token by token (what the model said, fixed)."""
    from types import SimpleNamespace

    def generate(ids, max_new, params, stop_ids=(), on_token=None, **kw):
        toks = tok.encode(reply)
        for t in toks:
            on_token(t)
        return SimpleNamespace(finish_reason="stop", tokens=toks)
    return OpenAIServer(generate, tok, "tiny", port=0, context=1024).start()


@pytest.mark.parametrize("reply, content, calls, finish", [
    ("Let me look.\n<tool_call>\n{\"name\": \"add\", \"arguments\": {\"a\": 1, \"b\": 2}}\n</tool_call>",
     "Let me look.", [("add", '{"a": 1, "b": 2}')], "tool_calls"),
    ("No tool is needed: the answer is <tool_ and so on", "No tool is needed: the answer is <tool_ and so on", [],
     "stop"),
    ("<tool_call>\nnot json\n</tool_call>", "<tool_call>\nnot json\n</tool_call>", [], "stop"),
    ("<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Rome } {\\\"x\"}}\n</tool_call>\n"
     "<tool_call>\n{\"arguments\": {\"a\": 5, \"b\": 6}, \"name\": \"add\"}\n</tool_call>\nDone.",
     "Done.", [("get_weather", '{"city": "Rome } {\\"x"}'), ("add", '{"a": 5, "b": 6}')], "tool_calls"),
])
def test_streamed_text_and_calls_are_the_whole_answers(tmp_path, reply, content, calls, finish):
    tok = bpe_tokenizer(tmp_path / "t")
    tok.chat_template = TOOL_TEMPLATE
    server = scripted_server(tok, reply)
    try:
        c = openai.OpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="none", max_retries=0)
        kw = dict(model="tiny", messages=ASK, tools=TOOLS, max_tokens=100)
        whole = c.chat.completions.create(**kw).choices[0]
        assert [(t.function.name, t.function.arguments) for t in whole.message.tool_calls or ()] == calls
        assert whole.message.content == (content or None) and whole.finish_reason == finish
        chunks = list(c.chat.completions.create(stream=True, **kw))
        texts = [ch.delta.content for chunk in chunks for ch in chunk.choices if ch.delta.content]
        got, pieces, streamed_finish = accumulate(chunks)
        assert "".join(texts) == content                 # the deltas add up to the message, exactly
        assert [(g["name"], g["arguments"]) for g in got] == calls and streamed_finish == finish
        if content and not content.startswith("<tool_call>") and not calls:
            assert len(texts) > 1                         # text streams as it comes
        if calls:                                          # the first call's arguments come in pieces
            assert pieces[0] > 1
    finally:
        server.stop()


def test_a_call_cut_by_max_tokens_streams_what_was_written(tmp_path):
    """A reply that ends inside a call's arguments: the call with the arguments written so far and
    finish_reason length, streamed and whole alike (as OpenAI's calls cut by max_tokens)."""
    tok = bpe_tokenizer(tmp_path / "t")
    tok.chat_template = TOOL_TEMPLATE
    from types import SimpleNamespace
    reply = "<tool_call>\n{\"name\": \"add\", \"arguments\": {\"a\": 1, \"b"

    def generate(ids, max_new, params, stop_ids=(), on_token=None, **kw):
        toks = tok.encode(reply)
        for t in toks:
            on_token(t)
        return SimpleNamespace(finish_reason="length", tokens=toks)
    server = OpenAIServer(generate, tok, "tiny", port=0, context=1024).start()
    try:
        c = openai.OpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="none", max_retries=0)
        kw = dict(model="tiny", messages=ASK, tools=TOOLS, max_tokens=100)
        whole = c.chat.completions.create(**kw).choices[0]
        assert whole.finish_reason == "length" and whole.message.content is None
        assert [(t.function.name, t.function.arguments) for t in whole.message.tool_calls] == [("add", '{"a": 1, "b')]
        got, _, finish = accumulate(c.chat.completions.create(stream=True, **kw))
        assert got == [{"name": "add", "arguments": '{"a": 1, "b'}] and finish == "length"
    finally:
        server.stop()


def test_an_agent_loop_sends_the_answer_back(client):
    first = client.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS, tool_choice="required",
                                           max_tokens=400, temperature=0).choices[0].message
    msgs = ASK + [first.model_dump(exclude_none=True)] + [
        {"role": "tool", "tool_call_id": c.id, "content": json.dumps({"result": 42})} for c in first.tool_calls]
    r = client.chat.completions.create(model="tiny", messages=msgs, tools=TOOLS, max_tokens=8, temperature=0)
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_auto_and_none_answer_text_or_calls(client):
    for choice in ("auto", "none"):
        r = client.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS, tool_choice=choice,
                                           max_tokens=12, temperature=0)
        c = r.choices[0]
        assert c.finish_reason in ("stop", "length") and isinstance(c.message.content, str)


def test_bad_tool_requests_are_400s_naming_the_field(client):
    bad = [({"tools": [{"type": "function", "function": {"name": "no spaces allowed"}}]}, "tools"),
           ({"tools": [WEATHER, WEATHER]}, "tools"),
           ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
           ({"tool_choice": "required"}, "tool_choice"),
           ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice")]
    for extra, param in bad:
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model="tiny", messages=ASK, max_tokens=4, extra_body=extra)
        assert e.value.body["param"] == param, (extra, e.value.body)
    # still serving: a real answer (sampled tokens of a random tiny model may decode to no text, so
    # the answer is checked by its tokens, not by its content being non-empty)
    r = client.chat.completions.create(model="tiny", messages=ASK, max_tokens=2)
    assert r.choices[0].finish_reason in ("stop", "length") and isinstance(r.choices[0].message.content, str)
    assert r.usage.prompt_tokens > 0 and 1 <= r.usage.completion_tokens <= 2 or r.choices[0].finish_reason == "stop"


def test_a_template_without_tool_support_is_a_400(tmp_path):
    tok = bpe_tokenizer(tmp_path / "t")
    tok.chat_template = TEMPLATE                 # renders messages only
    hub, server = _endpoint(tok)
    try:
        c = openai.OpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="none", max_retries=0)
        with pytest.raises(openai.BadRequestError) as e:
            c.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS, max_tokens=4)
        assert e.value.body["param"] == "tools" and "no tool support" in e.value.body["message"]
        assert c.chat.completions.create(model="tiny", messages=ASK, max_tokens=2).choices[0].finish_reason
    finally:
        server.stop()
        hub.stop()


def test_parse_calls_keeps_what_is_not_a_call():
    text = 'let me see\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>\n' \
           '<tool_call>\nnot json\n</tool_call>'
    content, calls = parse_calls(text)
    assert [c["function"] for c in calls] == [{"name": "add", "arguments": '{"a": 1, "b": 2}'}]
    assert content == "let me see\n\n<tool_call>\nnot json\n</tool_call>"
    assert parse_calls("plain") == ("plain", [])


def test_the_real_qwen_template_renders_tools_and_calls():
    gguf = sorted(glob.glob(str(pathlib.Path(__file__).resolve().parents[2] / "models" / "qwen2.5-coder-0.5b*.gguf")))
    if not gguf:
        pytest.skip("the Qwen2.5-Coder 0.5B GGUF is not fetched (make models)")
    from edge.api.tools import ToolRequest, render
    from edge.model.tokenizer import open_gguf
    template = open_gguf(gguf[0]).fields["tokenizer.chat_template"].contents()
    tok = bpe_tokenizer(pathlib.Path(__import__("tempfile").mkdtemp()) / "t")   # the template is what counts
    tok.chat_template = template
    call = {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}
    msgs = template_messages(ASK + [{"role": "assistant", "content": None, "tool_calls": [call]},
                                    {"role": "tool", "tool_call_id": "call_1", "content": "3"}])
    text = render(tok, msgs, ToolRequest(TOOLS, None))
    assert json.dumps(WEATHER["function"]["parameters"]["properties"]["city"]) in text.replace("\n", "")
    assert '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>' in text
    assert "<tool_response>\n3\n</tool_response>" in text
    _, calls = parse_calls(text.split("<|im_start|>assistant", 1)[1])
    assert [c["function"]["name"] for c in calls] == ["add"]
