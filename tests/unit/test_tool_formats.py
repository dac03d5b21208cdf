"""Tool calls as each family's models write them (edge/api/tool_formats/): real reply strings,
parsed whole and streamed (split at every character boundary, and character by character: the
same calls and content). Qwen / Hermes <tool_call>, the Qwen family's bare and fenced JSON,
llama 3.x, Mistral; text that only mentions a tool, or is not JSON, stays text."""
import json

import pytest

from edge.api.tool_formats import FAMILIES, detect
from edge.api.tool_formats.stream import CallStream

QWEN, HERMES, LLAMA3, MISTRAL = (FAMILIES[k] for k in ("qwen", "hermes", "llama3", "mistral"))
NAMES = ["get_weather", "add"]
PARIS = '{"city": "Paris", "unit": "c"}'


def whole(fmt, text, names=NAMES):
    p = CallStream(fmt, names)
    events = p.feed(text) + p.finish()
    return p, events


def summary(p):
    return p.content, [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in p.calls]


def replay(events):
    """What a client rebuilds from the events: content, and per call its name and arguments."""
    content, calls = "", {}
    for ev in events:
        if ev[0] == "content":
            content += ev[1]
        elif ev[0] == "call":
            assert ev[2]["function"]["arguments"] == "" and ev[1] not in calls
            calls[ev[1]] = [ev[2]["function"]["name"], ""]
        else:
            calls[ev[1]][1] += ev[2]
    return content, [(n, a) for n, a in (calls[i] for i in sorted(calls))]


def check(fmt, text, content, calls, names=NAMES):
    """The whole reply's content and calls; every split of it streams to the same answer."""
    p, events = whole(fmt, text, names)
    got = summary(p)
    assert got == (content, calls), got
    raw = [(c["function"]["name"], c["function"]["arguments"]) for c in p.calls]
    assert replay(events) == (p.content, raw)
    for k in range(len(text) + 1):                    # every boundary
        s = CallStream(fmt, names)
        ev = s.feed(text[:k]) + s.feed(text[k:]) + s.finish()
        assert replay(ev) == (p.content, raw), k
    s = CallStream(fmt, names)                        # character by character
    ev = [e for ch in text for e in s.feed(ch)] + s.finish()
    assert replay(ev) == (p.content, raw)
    return p


# ---- Qwen2.5 / Hermes <tool_call> ----
def test_qwen_tool_call_frame():
    text = '<tool_call>\n{"name": "get_weather", "arguments": ' + PARIS + '}\n</tool_call>'
    check(QWEN, text, "", [("get_weather", json.loads(PARIS))])
    check(HERMES, text, "", [("get_weather", json.loads(PARIS))])


def test_two_parallel_calls_with_text_before():
    text = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
            '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>\n')
    check(QWEN, text, "Let me check.", [("get_weather", {"city": "Paris"}), ("add", {"a": 1, "b": 2})])


def test_frame_with_parameters_string_arguments_or_keys_swapped():
    for body, args in [('{"name": "add", "parameters": {"a": 1, "b": 2}}', {"a": 1, "b": 2}),
                       ('{"name": "add", "arguments": "{\\"a\\": 1, \\"b\\": 2}"}', {"a": 1, "b": 2}),
                       ('{"arguments": {"a": 1}, "name": "add"}', {"a": 1})]:
        check(QWEN, f"<tool_call>\n{body}\n</tool_call>", "", [("add", args)])


def test_a_frame_that_is_not_a_call_is_text():
    for text in ['<tool_call>\n{"name": add, "arguments": {"a": 1}}\n</tool_call>',
                 '<tool_call>\nnot json\n</tool_call>', "<tool_call>\n{\"name\": \"add\""]:
        check(QWEN, text, text, [])


def test_a_frame_call_keeps_the_arguments_it_streamed():
    """Inside a frame a call is a call once its head is read; its arguments are then streamed as
    written (OpenAI's can be invalid JSON too), and a reply cut inside them leaves it incomplete."""
    p, _ = whole(QWEN, '<tool_call>\n{"name": "add", "arguments": {"a": 1,}}\n</tool_call>')
    assert [c["function"]["arguments"] for c in p.calls] == ['{"a": 1,}'] and not p.incomplete
    p, _ = whole(QWEN, '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b')
    assert [c["function"]["arguments"] for c in p.calls] == ['{"a": 1, "b'] and p.incomplete


# ---- the Qwen family's bare and fenced calls ----
def test_bare_object():
    check(QWEN, '{"name": "get_weather", "arguments": ' + PARIS + "}", "", [("get_weather", json.loads(PARIS))])


def test_fenced_block_as_qwen2_5_coder_1_5b_writes_it():
    text = ('```json\n{\n  "name": "get_weather",\n  "arguments": {\n    "city": "Paris",\n    "unit": "c"\n  }\n}\n'
            '```')
    check(QWEN, text, "", [("get_weather", json.loads(PARIS))])
    check(QWEN, "```\n" + text[8:] + "\n", "", [("get_weather", json.loads(PARIS))])


def test_bare_list_and_two_objects_and_two_fences():
    calls = [("get_weather", {"city": "Paris"}), ("add", {"a": 1, "b": 2})]
    one = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
    two = '{"name": "add", "parameters": {"a": 1, "b": 2}}'
    check(QWEN, f"[{one}, {two}]", "", calls)
    check(QWEN, f"{one}\n{two}\n", "", calls)
    check(QWEN, f"```json\n{one}\n```\n```json\n{two}\n```", "", calls)


def test_arguments_as_string_and_the_openai_shape():
    check(QWEN, '{"name": "add", "arguments": "{\\"a\\": 1, \\"b\\": 2}"}', "", [("add", {"a": 1, "b": 2})])
    check(QWEN, '{"type": "function", "function": {"name": "add", "arguments": {"a": 3, "b": 4}}}', "",
          [("add", {"a": 3, "b": 4})])


@pytest.mark.parametrize("text", [
    'I would call get_weather with {"city": "Paris"}.',
    'You can use {"name": "get_weather", "arguments": {"city": "Paris"}} to find out.',
    '{"name": "get_weather", "arguments": {"city": "Paris"}} is the call to make.',
    'Here is the call:\n```json\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n```',
    '{"name": "get_time", "arguments": {"city": "Paris"}}',             # not an offered tool
    '{"name": "get_weather", "arguments": {"city": "Paris"}, "extra": 1}',
    '{"answer": 42}',
    '[1, 2, 3]',
    '```python\nprint(get_weather("Paris"))\n```',
    '{"name": "get_weather", "arguments": {"city": Paris}}',           # malformed JSON
    '{"name": "get_weather", "arguments": {"city": "Paris"}',          # cut
    '```json\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n',   # fence never closed
])
def test_what_only_mentions_or_shows_a_call_is_text(text):
    check(QWEN, text, text, [])


def test_a_plain_answer_streams_as_it_comes():
    s = CallStream(QWEN, NAMES)
    assert s.feed("The weather") == [("content", "The weather")]
    s = CallStream(QWEN, NAMES)
    assert s.feed('{"name": "get_') == []                  # may still be a call: held
    assert s.feed('time"') == [("content", '{"name": "get_time"')]   # cannot be: let go


def test_hermes_without_qwen_and_without_names_reads_no_bare_calls():
    text = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
    check(HERMES, text, text, [])
    check(QWEN, text, text, [], names=None)


def test_frame_calls_stream_their_arguments_in_pieces():
    s = CallStream(QWEN, NAMES)
    ev = s.feed('<tool_call>\n{"name": "add", "arguments": {"a"') + s.feed(": 1}}\n</tool_call>") + s.finish()
    assert [e[0] for e in ev][:1] == ["call"] and [e[0] for e in ev].count("args") >= 2


def test_whitespace_only_reply_is_kept():
    check(QWEN, "  \n", "  \n", [])


# ---- llama 3.x ----
def test_llama3_bare_json_with_parameters():
    check(LLAMA3, '{"name": "get_weather", "parameters": {"city": "Paris"}}', "", [("get_weather", {"city": "Paris"})])
    check(LLAMA3, '{"type": "function", "name": "add", "parameters": {"a": 1, "b": 2}}', "",
          [("add", {"a": 1, "b": 2})])


def test_llama3_python_tag_json_and_two_calls():
    check(LLAMA3, '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}', "",
          [("get_weather", {"city": "Paris"})])
    check(LLAMA3, '{"name": "get_weather", "parameters": {"city": "Paris"}}; '
                  '{"name": "add", "parameters": {"a": 1, "b": 2}}',
          "", [("get_weather", {"city": "Paris"}), ("add", {"a": 1, "b": 2})])


def test_llama3_builtin_and_code():
    check(LLAMA3, '<|python_tag|>brave_search.call(query="weather in Paris")', "",
          [("brave_search", {"query": "weather in Paris"})], names=NAMES + ["brave_search"])
    check(LLAMA3, "<|python_tag|>print(1 + 1)", "", [("python", {"code": "print(1 + 1)"})], names=NAMES + ["python"])
    check(LLAMA3, "<|python_tag|>print(1 + 1)", "<|python_tag|>print(1 + 1)", [])


def test_llama3_prose_is_text():
    text = 'To get the weather, call {"name": "get_weather", "parameters": {"city": "Paris"}}.'
    check(LLAMA3, text, text, [])


# ---- Mistral ----
def test_mistral_tool_calls_list_keeps_its_id():
    text = '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}, "id": "abc123def"}]'
    p = check(MISTRAL, text, "", [("get_weather", {"city": "Paris"})])
    assert p.calls[0]["id"] == "abc123def"


def test_mistral_two_calls_and_v11_form():
    two = [("get_weather", {"city": "Paris"}), ("add", {"a": 1, "b": 2})]
    check(MISTRAL, '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, '
                   '{"name": "add", "arguments": {"a": 1, "b": 2}}]', "", two)
    p = check(MISTRAL, '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]add[ARGS]{"a": 1, "b": 2}', "", two)
    assert all(len(c["id"]) == 9 and c["id"].isalnum() for c in p.calls)
    check(MISTRAL, 'Sure.[TOOL_CALLS]get_weather[CALL_ID]x1y2z3w4v[ARGS]{"city": "Paris"}', "Sure.",
          [("get_weather", {"city": "Paris"})])


def test_mistral_malformed_is_text():
    text = '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}'
    check(MISTRAL, text, text, [])


# ---- which family ----
def test_detect_reads_the_template():
    class Tok:
        def __init__(self, template, vocab=()):
            self.chat_template, self.vocab = template, vocab

        def token_to_id(self, t):
            return 1 if t in self.vocab else None
    assert detect(Tok("<|im_start|>... <tool_call> ... You are Qwen")).family == "qwen"
    assert detect(Tok("<|im_start|>... <tool_call>", ["<|fim_pad|>"])).family == "qwen"
    assert detect(Tok("<|im_start|>... <tool_call>")).family == "hermes"
    assert detect(Tok('<|start_header_id|>ipython<|end_header_id|> "parameters"')).family == "llama3"
    assert detect(Tok("{{ '<|python_tag|>' }}")).family == "llama3"
    assert detect(Tok("[AVAILABLE_TOOLS] [TOOL_CALLS]")).family == "mistral"
    assert detect(Tok("{{ messages }}")).family == "hermes"
    assert detect(None).family == "hermes"
