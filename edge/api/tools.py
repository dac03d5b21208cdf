"""Tool calling: `tools` and `tool_choice` rendered by the model's own chat template, and the
reply's tool calls parsed back in the form the model's family writes them (edge/api/tool_formats/:
Qwen2.5 / Hermes <tool_call>, llama 3.x, Mistral [TOOL_CALLS]; the family read off the template).

* The tools go to the template as `tools` (a Jinja2 sandbox, edge/model/tokenizer.py), the way
  transformers and llama.cpp hand them over. A template that does not render them (no tool
  support: the tool's name never appears in the prompt) is a 400 naming `tools`.
* tool_choice "auto" (the default): the model decides; "none": the tools are not rendered and
  the answer is text; "required" or {"type": "function", "function": {"name"}}: the reply is
  constrained (edge/speculative/grammar.py, the same lossless machinery as response_format) to one tool
  call -- or, with parallel_tool_calls not false, one or more -- of the allowed functions in the
  family's call frame, with arguments that follow each function's JSON schema.
* The reply's calls become message.tool_calls ({id, type: function, function: {name, arguments:
  a JSON string}}) and finish_reason "tool_calls"; the text around them stays the content (None
  when there is none). One parser (edge/api/tool_formats/stream.py) reads streamed and whole replies.
* Messages may carry what an agent loop sends back: an assistant message with tool_calls (its
  arguments handed to the template as an object, as transformers does) and role "tool" messages.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import List, Optional, Tuple

from edge.api.request_fields import BadRequest
from edge.api.tool_formats import ToolFormat, detect
from edge.api.tool_formats.frame import marker_ids
from edge.api.tool_formats.stream import CallStream

__all__ = ["CallStream", "ToolRequest", "call_grammar_lark", "call_stream", "kept_markers", "parse_calls",
           "read_tools", "render", "template_messages"]

MAX_TOOLS = 128
_NAME = re.compile(r"[A-Za-z0-9_.\-]{1,64}\Z")
_PROBE = "starsun_probe_tool"


@dataclass
class ToolRequest:
    """What a request's tools ask of the generation."""
    tools: List[dict]                 # as the template gets them ({type: function, function: {...}})
    forced: Optional[List[str]]       # names one of which must be called (None: the model decides)
    parallel: bool = True             # more than one call allowed when forced
    format: Optional[ToolFormat] = None   # the model's call format (None: read off the tokenizer)


def read_tools(body: dict, tok=None) -> Optional[ToolRequest]:
    """The request's tools and tool_choice, checked; None when no tool is offered (or choice none).
    tok: the model's tokenizer, whose chat template says the call format."""
    plan = _read_tools(body)
    if plan is not None:
        plan.format = detect(tok)
    return plan


def _read_tools(body: dict) -> Optional[ToolRequest]:
    tools = body.get("tools")
    choice = body.get("tool_choice")
    if not tools:
        if choice not in (None, "none", "auto"):
            raise BadRequest("'tool_choice' needs 'tools'", "tool_choice")
        return None
    if not isinstance(tools, list) or len(tools) > MAX_TOOLS:
        raise BadRequest(f"'tools' must be a list of at most {MAX_TOOLS} tools", "tools")
    names = []
    for t in tools:
        fn = t.get("function") if isinstance(t, dict) and t.get("type") == "function" else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not _NAME.match(fn["name"]):
            raise BadRequest("each tool must be {type: function, function: {name (1-64 of A-Z a-z 0-9 _ . -), "
                             "description, parameters}}", "tools")
        if not isinstance(fn.get("parameters", {}), dict):
            raise BadRequest(f"tool {fn['name']!r}: 'parameters' must be a JSON schema object", "tools")
        names.append(fn["name"])
    if len(set(names)) != len(names):
        raise BadRequest("tool names must be unique", "tools")
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise BadRequest("'parallel_tool_calls' must be true or false", "parallel_tool_calls")
    if choice in (None, "auto"):
        return ToolRequest(tools, None, parallel is not False)
    if choice == "none":
        return None
    if choice == "required":
        return ToolRequest(tools, names, parallel is not False)
    named = choice.get("function", {}).get("name") if isinstance(choice, dict) and \
        choice.get("type") == "function" and isinstance(choice.get("function"), dict) else None
    if named not in names:
        raise BadRequest("'tool_choice' must be none, auto, required or {type: function, function: {name}} "
                         "naming one of the tools", "tool_choice")
    return ToolRequest(tools, [named], parallel is not False)


def template_messages(messages: list) -> List[dict]:
    """Chat messages for the template: an assistant's tool_calls with their arguments as objects
    (the template writes them with tojson), a tool message's content as text."""
    out = []
    for m in messages:
        m = dict(m)
        calls = m.get("tool_calls")
        if calls is not None:
            if m.get("role") != "assistant" or not isinstance(calls, list):
                raise BadRequest("'tool_calls' belongs to assistant messages, as a list", "messages")
            m["tool_calls"] = [_template_call(c) for c in calls]
            if m.get("content") is None:
                m["content"] = ""
        out.append(m)
    return out


def _template_call(c) -> dict:
    fn = c.get("function") if isinstance(c, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise BadRequest("an assistant tool_call must be {id, type: function, function: {name, arguments}}",
                         "messages")
    args = fn.get("arguments", "{}")
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except ValueError:
            raise BadRequest(f"tool_call {fn['name']!r}: 'arguments' is not JSON", "messages") from None
    return {"id": c.get("id"), "type": "function", "function": {"name": fn["name"], "arguments": args}}


def render(tok, messages: List[dict], plan: Optional[ToolRequest]) -> str:
    """The prompt: the model's chat template over the messages and (if any) the tools. A template
    that does not show the tools to the model is a 400 naming `tools`."""
    if plan is None:
        return tok.apply_chat_template(messages)
    probe = [{"type": "function", "function": {"name": _PROBE, "description": "", "parameters": {}}}]
    try:
        shown = _PROBE in tok.apply_chat_template([{"role": "user", "content": "x"}], tools=probe)
    except ValueError:
        shown = False
    if not shown:
        raise BadRequest("this model's chat template has no tool support (it does not render 'tools'); "
                         "send the request without tools", "tools")
    return tok.apply_chat_template(messages, tools=plan.tools)


def call_grammar_lark(plan: ToolRequest, tok=None) -> str:
    """A Lark grammar (llguidance) for the reply a forced tool_choice allows, in the model's own
    call frame (edge/api/tool_formats/): one call -- or several when parallel -- of an allowed
    function whose arguments follow its parameters schema. tok: the tokenizer, whose single-token
    markers (Qwen2.5's <tool_call>) the grammar names as tokens."""
    return (plan.format or detect(tok)).grammar(plan, tok)


def call_stream(plan: Optional[ToolRequest]) -> CallStream:
    """The parser of a reply to a request with these tools (the offered names: bare calls must
    name one of them)."""
    if plan is None:
        return CallStream()
    return CallStream(plan.format, [t["function"]["name"] for t in plan.tools])


def kept_markers(plan: Optional[ToolRequest], tok) -> dict:
    """{token id: text} of the call markers the reply's text must keep though the tokenizer may
    skip them as special tokens when decoding (llama 3.x's <|python_tag|>, Mistral's [TOOL_CALLS])."""
    if plan is None:
        return {}
    return marker_ids(tok, (plan.format or detect(tok)).keep)


def parse_calls(text: str, plan: Optional[ToolRequest] = None) -> Tuple[Optional[str], list]:
    """(content, tool_calls) of a whole reply, read as CallStream reads it streamed: content None
    when the calls are all there is."""
    p = call_stream(plan)
    p.feed(text)
    p.finish()
    if not p.calls:
        return p.content, []
    return p.content or None, p.calls
