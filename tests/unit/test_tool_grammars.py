"""A forced tool_choice's grammar is the model family's call frame (edge/api/tool_formats/): on
the real Qwen2.5 tokenizer its <tool_call> / </tool_call> are the tokenizer's own tokens (a text
literal of them is what looped: llguidance's mask offered the special token and then refused
it), the text it allows parses into the calls, and llama 3.x / Mistral frames do the same."""
import json

import pytest

pytest.importorskip("llguidance")

from edge.api.tool_formats import FAMILIES  # noqa: E402
from edge.api.tools import ToolRequest, call_grammar_lark, parse_calls  # noqa: E402
from edge.model.fetch import model_path  # noqa: E402
from edge.speculative.grammar import Grammar, grammar_from_lark, grammar_tokenizer  # noqa: E402

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "required": ["city"], "properties": {"city": {"type": "string"},
                                                            "unit": {"type": "string", "enum": ["c", "f"]}}}}}
ADD = {"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "required": ["a", "b"], "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}}
TOOLS = [WEATHER, ADD]
CALL = '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}'


@pytest.fixture(scope="module")
def qwen():
    path = model_path("qwen2.5-coder-0.5b")
    if not path.exists():
        pytest.skip(f"{path.name} is not fetched (make models): the real Qwen2.5 tokenizer is what this tests")
    from edge.model.tokenizer import Tokenizer
    tok = Tokenizer.from_gguf(path)
    return tok, grammar_tokenizer(tok)


def plan(family, forced=("get_weather", "add"), parallel=True):
    return ToolRequest(TOOLS, list(forced), parallel, FAMILIES[family])


def matcher(lark, llg_tok):
    return Grammar(grammar_from_lark(lark), llg_tok).matcher()


def test_qwen_required_grammar_uses_the_special_tokens_and_never_loops(qwen):
    tok, llg = qwen
    lark = call_grammar_lark(plan("qwen"), tok)
    open_id, close_id = tok.token_to_id("<tool_call>"), tok.token_to_id("</tool_call>")
    assert f"<[{open_id}]>" in lark and f"<[{close_id}]>" in lark and '"<tool_call>' not in lark
    m = matcher(lark, llg)
    first = m.allowed().nonzero()[0].tolist()
    assert first == [open_id] and m.consume(open_id)          # what the mask offers, it takes
    text = f"<tool_call>\n{CALL}\n</tool_call>\n"
    ids = tok.encode(text)
    assert ids[0] == open_id and close_id in ids
    assert m.sync(ids) and all(m.allowed()[e] for e in tok.eos_ids if e < len(m.allowed()))
    content, calls = parse_calls(tok.decode(ids, skip_special=True), plan("qwen"))
    assert content is None and [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == \
        [("get_weather", {"city": "Paris", "unit": "c"})]


def test_qwen_named_function_and_parallel_false(qwen):
    tok, llg = qwen
    m = matcher(call_grammar_lark(plan("qwen", ["add"], parallel=False), tok), llg)
    assert not m.sync(tok.encode(f"<tool_call>\n{CALL}\n</tool_call>"))          # not the named one
    m = matcher(call_grammar_lark(plan("qwen", ["add"], parallel=False), tok), llg)
    one = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
    assert m.sync(tok.encode(one))
    assert not m.sync(tok.encode(one + "\n" + one))                               # one call only


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from harness.grammars import bpe_tokenizer
    tok = bpe_tokenizer(tmp_path_factory.mktemp("tok") / "t")
    return tok, grammar_tokenizer(tok)


@pytest.mark.parametrize("family, text, calls", [
    ("llama3", '{"name": "get_weather", "parameters": {"city": "Paris"}}', [("get_weather", {"city": "Paris"})]),
    ("llama3", '{"name": "get_weather", "parameters": {"city": "Paris"}}; '
               '{"name": "add", "parameters": {"a": 1, "b": 2}}',
     [("get_weather", {"city": "Paris"}), ("add", {"a": 1, "b": 2})]),
    ("mistral", '[TOOL_CALLS][{"name": "add", "arguments": {"a": 1, "b": 2}}]', [("add", {"a": 1, "b": 2})]),
    ("hermes", '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>',
     [("add", {"a": 1, "b": 2})]),
])
def test_each_family_grammar_allows_its_frame_and_that_parses_back(tiny, family, text, calls):
    tok, llg = tiny
    p = plan(family)
    m = matcher(call_grammar_lark(p, tok), llg)
    assert m.sync(tok.encode(text)), text
    content, got = parse_calls(text, p)
    assert content is None and [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in got] == calls


def test_a_special_marker_is_named_as_its_token(tmp_path):
    """A tokenizer with [TOOL_CALLS] as a special token: the grammar names it <[id]>, not its text."""
    from tokenizers import AddedToken

    from harness.grammars import bpe_tokenizer
    tok = bpe_tokenizer(tmp_path / "t")
    tok._tok.add_tokens([AddedToken("[TOOL_CALLS]", special=True, normalized=False)])
    tid = tok.token_to_id("[TOOL_CALLS]")
    tok.vocab_size = tid + 1
    lark = call_grammar_lark(plan("mistral"), tok)
    assert lark.startswith(f"start: <[{tid}]>")
    m = matcher(lark, grammar_tokenizer(tok))
    assert m.sync(tok.encode('[TOOL_CALLS][{"name": "add", "arguments": {"a": 1, "b": 2}}]'))
