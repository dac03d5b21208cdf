"""Tool calling: `tools` and `tool_choice` rendered by the model's own chat template, and the
reply's tool calls parsed back (Qwen2.5 / Hermes style: <tool_call>{"name", "arguments"}</tool_call>).

* The tools go to the template as `tools` (a Jinja2 sandbox, edge/model/tokenizer.py), the way
  transformers and llama.cpp hand them over. A template that does not render them (no tool
  support: the tool's name never appears in the prompt) is a 400 naming `tools`.
* tool_choice "auto" (the default): the model decides; "none": the tools are not rendered and
  the answer is text; "required" or {"type": "function", "function": {"name"}}: the reply is
  constrained (edge/speculative/grammar.py, the same lossless machinery as response_format) to one tool
  call -- or, with parallel_tool_calls not false, one or more -- of the allowed functions,
  with arguments that follow each function's JSON schema.
* The reply's <tool_call> blocks become message.tool_calls ({id, type: function, function:
  {name, arguments: a JSON string}}) and finish_reason "tool_calls"; the text around them stays
  the content (None when there is none).
* Messages may carry what an agent loop sends back: an assistant message with tool_calls (its
  arguments handed to the template as an object, as transformers does) and role "tool" messages.
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import List, Optional, Tuple

from edge.api.request_fields import BadRequest

OPEN, CLOSE = "<tool_call>", "</tool_call>"
MAX_TOOLS = 128
_NAME = re.compile(r"[A-Za-z0-9_.\-]{1,64}\Z")
_PROBE = "starsun_probe_tool"


@dataclass
class ToolRequest:
    """What a request's tools ask of the generation."""
    tools: List[dict]                 # as the template gets them ({type: function, function: {...}})
    forced: Optional[List[str]]       # names one of which must be called (None: the model decides)
    parallel: bool = True             # more than one call allowed when forced


def read_tools(body: dict) -> Optional[ToolRequest]:
    """The request's tools and tool_choice, checked; None when no tool is offered (or choice none)."""
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


def call_grammar_lark(plan: ToolRequest) -> str:
    """A Lark grammar (llguidance) for the reply a forced tool_choice allows: one <tool_call> block
    -- or several, one per line, when parallel -- whose JSON names an allowed function and whose
    arguments follow its parameters schema."""
    variants = []
    for t in plan.tools:
        fn = t["function"]
        if fn["name"] not in plan.forced:
            continue
        params = fn.get("parameters") or {"type": "object"}
        variants.append({"type": "object", "properties": {"name": {"const": fn["name"]}, "arguments": params},
                         "required": ["name", "arguments"], "additionalProperties": False})
    schema = {"anyOf": variants} if len(variants) > 1 else variants[0]
    schema = {**schema, "x-guidance": {"whitespace_flexible": False, "item_separator": ", ",
                                       "key_separator": ": "}}
    call = f'"{OPEN}\\n" %json {json.dumps(schema)} "\\n{CLOSE}"'
    more = ' ("\\n" call)*' if plan.parallel else ""
    return f"start: call{more}\ncall: {call}\n"


class CallStream:
    """The reply's tool calls read as its text arrives, the one parser of the streamed and the
    whole answer (so the streamed deltas add up to exactly the non-streamed message).

    feed(text) and finish() return events, in order:
      ("content", text)            text outside the calls
      ("call", index, call)        a call begins: call = {id, type, function: {name, arguments: ""}}
      ("args", index, text)        more of that call's arguments (a JSON string's next characters)
    and `calls` / `content` / `incomplete` hold the answer so far.

    A block <tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call> is a call as soon as its
    name and the arguments' opening brace have arrived; its arguments then stream as the model
    writes them (the raw JSON text of the object, which is what `arguments` carries) up to their
    closing brace, and the rest of the block up to </tool_call> is markup. A block in any other
    shape (arguments first, arguments as a string, "parameters") waits for its </tool_call>: a
    JSON object with a name is then a call (arguments as JSON text), anything else stays text.
    A reply that ends inside a call's arguments leaves that call `incomplete` (cut, as OpenAI's
    calls cut by max_tokens are). Text: whitespace before a call and at the end of a reply with
    calls is dropped, and so is whitespace that opens the text after a call; a reply without
    calls is its text exactly."""

    def __init__(self) -> None:
        self.calls: List[dict] = []
        self.content = ""
        self.incomplete = False
        self._buf = ""            # text not decided yet
        self._ws = ""             # content whitespace held back (it may be the end of the content)
        self._mode = "text"       # text | head | held | args | tail
        self._depth, self._in_str, self._esc = 0, False, False

    def feed(self, text: str) -> list:
        self._buf += text
        out: list = []
        while self._step(out):
            pass
        return out

    def finish(self) -> list:
        """The reply is whole: what was held back is decided."""
        out: list = []
        mode, rest = self._mode, self._buf
        self._buf = ""
        if mode == "text":
            self._text(rest, out)
        elif mode in ("head", "held"):                 # an unclosed block that never was a call: text
            self._text(OPEN + rest, out)
        elif mode == "args":
            self.incomplete = True
        self._mode = "text"
        if not self.calls and self._ws:                # a reply without calls keeps its text exactly
            out.append(("content", self._ws))
            self.content += self._ws
        self._ws = ""
        return out

    # ---- one step of the state machine; False when it needs more text ----
    def _step(self, out: list) -> bool:
        buf, mode = self._buf, self._mode
        if mode == "text":
            i = buf.find(OPEN)
            if i >= 0:
                self._text(buf[:i], out)
                self._buf, self._mode = buf[i + len(OPEN):], "head"
                return True
            hold = _open_prefix(buf)
            self._text(buf[:len(buf) - hold], out)
            self._buf = buf[len(buf) - hold:]
            return False
        if mode == "head":
            got = _call_head(buf)
            if got is None:
                return False
            if got is False:
                self._mode = "held"
                return True
            name, j = got
            call = {"id": _call_id(), "type": "function", "function": {"name": name, "arguments": ""}}
            self.calls.append(call)
            out.append(("call", len(self.calls) - 1, {**call, "function": dict(call["function"])}))
            self._buf, self._mode = buf[j:], "args"
            self._depth, self._in_str, self._esc = 1, False, False
            self._args("{", out)
            return True
        if mode == "args":
            end = self._scan(buf)
            self._args(buf[:end], out)
            self._buf = buf[end:]
            if self._depth == 0:
                self._mode = "tail"
                return True
            return False
        i = buf.find(CLOSE)                            # tail or held: up to </tool_call>
        if i < 0:
            return False
        block, self._buf, self._mode = buf[:i], buf[i + len(CLOSE):], "text"
        if mode == "held":
            call = _whole_call(block)
            if call is None:
                self._text(OPEN + block + CLOSE, out)
            else:
                self.calls.append(call)
                i = len(self.calls) - 1
                out.append(("call", i, {**call, "function": {**call["function"], "arguments": ""}}))
                if call["function"]["arguments"]:
                    out.append(("args", i, call["function"]["arguments"]))
        return True

    def _scan(self, buf: str) -> int:
        """How much of buf belongs to the arguments object (its end: the brace closing it)."""
        for k, ch in enumerate(buf):
            if self._in_str:
                if self._esc:
                    self._esc = False
                elif ch == "\\":
                    self._esc = True
                elif ch == '"':
                    self._in_str = False
            elif ch == '"':
                self._in_str = True
            elif ch in "{[":
                self._depth += 1
            elif ch in "}]":
                self._depth -= 1
                if self._depth == 0:
                    return k + 1
        return len(buf)

    def _args(self, text: str, out: list) -> None:
        if text:
            i = len(self.calls) - 1
            self.calls[i]["function"]["arguments"] += text
            out.append(("args", i, text))

    def _text(self, text: str, out: list) -> None:
        if not text:
            return
        text = self._ws + text
        kept = text.rstrip()
        self._ws = text[len(kept):]
        if self.calls and not self.content:            # the text after a call opens without its blank
            kept = kept.lstrip()
        if kept:
            out.append(("content", kept))
            self.content += kept


def _open_prefix(text: str) -> int:
    """The length of text's longest suffix that may be the start of <tool_call>."""
    for n in range(min(len(OPEN) - 1, len(text)), 0, -1):
        if text.endswith(OPEN[:n]):
            return n
    return 0


def _call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


_HEAD = ("ws", "{", "ws", '"name"', "ws", ":", "ws", "name", "ws", ",", "ws", ('"arguments"', '"parameters"'),
         "ws", ":", "ws", "{")


def _call_head(buf: str):
    """A block's start `{"name": "<name>", "arguments": {`: (name, index after the brace); None:
    the text so far may still become one; False: it cannot."""
    i, name = 0, None
    for part in _HEAD:
        if part == "ws":
            while i < len(buf) and buf[i] in " \t\r\n":
                i += 1
            continue
        rest = buf[i:]
        if part == "name":
            if not rest:
                return None
            if rest[0] != '"':
                return False
            end = _string_end(rest)
            if end is None:
                return None if len(rest) < 256 else False
            try:
                name = json.loads(rest[:end])
            except ValueError:
                return False
            i += end
            continue
        options = part if isinstance(part, tuple) else (part,)
        hit = next((o for o in options if rest.startswith(o)), None)
        if hit is None:
            return None if any(o.startswith(rest) for o in options) else False
        i += len(hit)
    return name, i


def _string_end(text: str) -> Optional[int]:
    """The index after the closing quote of the JSON string text starts with (None: not closed yet)."""
    esc = False
    for k in range(1, len(text)):
        if esc:
            esc = False
        elif text[k] == "\\":
            esc = True
        elif text[k] == '"':
            return k + 1
    return None


def _whole_call(block: str) -> Optional[dict]:
    """A whole block's call ({"name", "arguments" or "parameters"} in any order), or None."""
    try:
        obj = json.loads(block)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    return {"id": _call_id(), "type": "function",
            "function": {"name": obj["name"], "arguments": args if isinstance(args, str) else json.dumps(args)}}


def parse_calls(text: str) -> Tuple[Optional[str], list]:
    """(content, tool_calls) of a whole reply, read as CallStream reads it streamed: content None
    when the calls are all there is."""
    p = CallStream()
    p.feed(text)
    p.finish()
    if not p.calls:
        return p.content, []
    return p.content or None, p.calls
