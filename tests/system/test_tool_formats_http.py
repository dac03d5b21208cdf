"""Tool calls as real models write them, through the OpenAI endpoint (edge/api/tool_formats/),
with the official openai client.

The real Qwen2.5-Coder-0.5B (GGUF, llama.cpp, greedy) behind the endpoint, the get_weather
example of issue #44: tool_choice auto (it answers with the bare JSON call), required and a
named function (held to <tool_call> frames made of the tokenizer's own <tool_call> tokens: no
loop), and streamed (the call's delta, then its arguments; finish_reason tool_calls). Scripted
replies on the real Qwen tokenizer: <tool_call> written as its special token or spelled out in
ordinary tokens is the same call. A special marker a decode would skip (Mistral's [TOOL_CALLS])
is kept in the text, so its calls are found.
"""
import functools
import json
from types import SimpleNamespace

import pytest

pytest.importorskip("llguidance")
openai = pytest.importorskip("openai")

from edge.api.openai_http import OpenAIServer  # noqa: E402
from edge.model.fetch import model_path  # noqa: E402

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "required": ["city"],
                   "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["c", "f"]}}}}}
ASK = [{"role": "user", "content": "What is the weather in Paris? Use the tool."}]
QWEN = model_path("qwen2.5-coder-0.5b")


def _qwen_tokenizer():
    if not QWEN.exists():
        pytest.skip(f"{QWEN.name} is not fetched (make models): these tests run the real Qwen2.5-Coder-0.5B")
    from edge.model.tokenizer import Tokenizer
    return Tokenizer.from_gguf(QWEN)


def _client(server):
    return openai.OpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="none", max_retries=0)


@pytest.fixture(scope="module")
def qwen():
    tok = _qwen_tokenizer()
    pytest.importorskip("llama_cpp")
    from edge.engines.loader import load_engine
    from edge.speculative.generate import generate_plain
    engine = load_engine(QWEN, backend="llamacpp", max_len=2048)
    server = OpenAIServer(functools.partial(generate_plain, engine), tok, "qwen2.5-coder-0.5b", port=0,
                          context=2048).start()
    yield _client(server)
    server.stop()


def accumulate(chunks):
    """The streamed answer as a client rebuilds it: content, calls [(name, arguments)], finish,
    and how many argument deltas each call had; each call's first delta names it, arguments ""."""
    content, calls, pieces, finish = "", {}, {}, None
    for chunk in chunks:
        for ch in chunk.choices:
            finish = ch.finish_reason or finish
            content += ch.delta.content or ""
            for d in ch.delta.tool_calls or ():
                if d.index not in calls:
                    assert d.id and d.type == "function" and d.function.arguments == ""
                    calls[d.index] = [d.function.name, ""]
                else:
                    assert d.id is None and d.function.name is None
                    calls[d.index][1] += d.function.arguments
                    pieces[d.index] = pieces.get(d.index, 0) + 1
    return content, [tuple(calls[i]) for i in sorted(calls)], finish, [pieces.get(i, 0) for i in sorted(calls)]


def weather_calls(calls):
    """Every call is get_weather with JSON arguments naming a city."""
    assert calls
    for name, args in calls:
        assert name == "get_weather"
        assert isinstance(json.loads(args).get("city"), str), args
    return calls


KW = dict(model="qwen2.5-coder-0.5b", messages=ASK, tools=[WEATHER], temperature=0, max_tokens=60)
CHOICES = {"auto": {}, "required": {"tool_choice": "required"},
           "named": {"tool_choice": {"type": "function", "function": {"name": "get_weather"}}}}


@pytest.mark.parametrize("choice", list(CHOICES))
def test_real_qwen_answers_with_a_tool_call(qwen, choice):
    r = qwen.chat.completions.create(**KW, **CHOICES[choice]).choices[0]
    assert r.finish_reason == "tool_calls", r
    assert r.message.content is None
    weather_calls([(c.function.name, c.function.arguments) for c in r.message.tool_calls])


@pytest.mark.parametrize("choice", ["auto", "required"])
def test_real_qwen_streams_the_same_call(qwen, choice):
    whole = qwen.chat.completions.create(**KW, **CHOICES[choice]).choices[0].message
    content, calls, finish, pieces = accumulate(qwen.chat.completions.create(stream=True, **KW, **CHOICES[choice]))
    assert finish == "tool_calls" and content == ""
    assert weather_calls(calls) == [(c.function.name, c.function.arguments) for c in whole.tool_calls]
    if choice == "required":                    # a <tool_call> frame: the arguments stream as written
        assert pieces[0] > 1


def _scripted(tok, ids):
    """An endpoint whose generation writes exactly these token ids."""
    def generate(prompt, max_new, params, stop_ids=(), on_token=None, **kw):
        for t in ids:
            on_token(t)
        return SimpleNamespace(finish_reason="stop", tokens=list(ids))
    return OpenAIServer(generate, tok, "scripted", port=0, context=4096).start()


def _both_ways(tok, ids):
    server = _scripted(tok, ids)
    try:
        c = _client(server)
        kw = dict(model="scripted", messages=ASK, tools=[WEATHER], max_tokens=100)
        r = c.chat.completions.create(**kw).choices[0]
        whole = (r.message.content, [(t.function.name, t.function.arguments) for t in r.message.tool_calls or ()],
                 r.finish_reason)
        content, calls, finish, _ = accumulate(c.chat.completions.create(stream=True, **kw))
        assert (content or None, calls, finish) == whole
        return whole
    finally:
        server.stop()


def test_tool_call_as_the_special_token_or_spelled_out_is_the_same_call():
    tok = _qwen_tokenizer()
    body = '\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
    special = tok.encode("<tool_call>" + body + "</tool_call>")
    spelled = [i for piece in ("<", "tool", "_call", ">") for i in tok.encode(piece)] + tok.encode(body) + \
        [i for piece in ("</", "tool", "_call", ">") for i in tok.encode(piece)]
    assert tok.token_to_id("<tool_call>") in special and tok.token_to_id("<tool_call>") not in spelled
    expect = (None, [("get_weather", '{"city": "Paris"}')], "tool_calls")
    assert _both_ways(tok, special) == expect
    assert _both_ways(tok, spelled) == expect


def test_bare_and_fenced_calls_and_prose_on_the_real_qwen_tokenizer():
    tok = _qwen_tokenizer()
    call = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
    expect = (None, [("get_weather", '{"city": "Paris"}')], "tool_calls")
    assert _both_ways(tok, tok.encode(call)) == expect
    assert _both_ways(tok, tok.encode("```json\n" + call + "\n```")) == expect
    prose = "I would use get_weather with " + call + " if I could."
    assert _both_ways(tok, tok.encode(prose)) == (prose, [], "stop")


def test_a_special_marker_the_decode_skips_is_kept(tmp_path):
    from tokenizers import AddedToken

    from harness.grammars import bpe_tokenizer
    tok = bpe_tokenizer(tmp_path / "t")
    tok._tok.add_tokens([AddedToken("[TOOL_CALLS]", special=True, normalized=False)])
    tok.vocab_size = tok.token_to_id("[TOOL_CALLS]") + 1
    tok.chat_template = ("[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]{% for m in messages %}"
                         "{% if m.tool_calls %}[TOOL_CALLS]{{ m.tool_calls | tojson }}{% else %}"
                         "[INST]{{ m.content }}[/INST]{% endif %}{% endfor %}")      # Mistral's shape
    ids = tok.encode('[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}, "id": "a1b2c3d4e"}]')
    assert tok.decode(ids, skip_special=True).startswith("[{")            # the decode alone drops it
    content, calls, finish = _both_ways(tok, ids)
    assert (content, calls, finish) == (None, [("get_weather", '{"city": "Paris"}')], "tool_calls")
