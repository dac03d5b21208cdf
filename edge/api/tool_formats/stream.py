"""The reply's tool calls read as its text arrives: the one parser of the streamed and the whole
answer (so the streamed deltas add up to exactly the non-streamed message), for any family's
format (edge/api/tool_formats/__init__.py).

feed(text) and finish() return events, in order:
  ("content", text)            text outside the calls
  ("call", index, call)        a call begins: call = {id, type, function: {name, arguments: ""}}
  ("args", index, text)        more of that call's arguments (a JSON string's next characters)
and `calls` / `content` / `incomplete` hold the answer so far.

* A frame with a close marker (<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>) is
  a call as soon as its name and the arguments' opening brace have arrived; its arguments then
  stream as the model writes them (the raw JSON text of the object) up to their closing brace,
  and the rest of the frame up to its close is markup. A frame in another shape (arguments first,
  as a string, "parameters") waits for its close and is then read whole: calls, or text.
* A frame that runs to the end of the reply ([TOOL_CALLS] [...], <|python_tag|>...) is read whole
  when the reply ends: calls, or text.
* With a lenient format and the offered names, a reply that starts like a bare or fenced JSON
  call is held back while it can still be one, and is calls only if it is wholly calls to
  offered tools (edge/api/tool_formats/lenient.py); the moment it cannot be, it is text.
* A reply that ends inside a call's arguments leaves that call `incomplete` (cut, as OpenAI's
  calls cut by max_tokens are). Text: whitespace before a call and at the end of a reply with
  calls is dropped, and so is whitespace that opens the text after a call; a reply without
  calls is its text exactly.
"""
from __future__ import annotations

import json
from typing import Iterable, List, Optional

from edge.api.tool_formats.calls import call_id, marker_suffix, string_end
from edge.api.tool_formats.frame import Frame, ToolFormat
from edge.api.tool_formats.hermes import HERMES
from edge.api.tool_formats.lenient import Probe, whole_reply_calls

_HEAD = ("ws", "{", "ws", '"name"', "ws", ":", "ws", "name", "ws", ",", "ws", ('"arguments"', '"parameters"'),
         "ws", ":", "ws", "{")


class CallStream:
    """One reply's parser. fmt: the model's format (hermes when None); names: the offered tools
    (a lenient format's bare calls must name one of them; None: no bare calls)."""

    def __init__(self, fmt: Optional[ToolFormat] = None, names: Optional[Iterable[str]] = None) -> None:
        self.fmt = fmt or HERMES
        self.names = None if names is None else sorted(set(names))
        self.calls: List[dict] = []
        self.content = ""
        self.incomplete = False
        self._buf = ""            # text not decided yet
        self._ws = ""             # content whitespace held back (it may be the end of the content)
        self._frame: Optional[Frame] = None
        self._probe = Probe(self.names) if self.fmt.lenient and self.names else None
        self._mode = "probe" if self._probe else "text"    # probe | text | head | held | args | tail | rest
        self._depth, self._in_str, self._esc = 0, False, False

    def feed(self, text: str) -> list:
        self._buf += text
        out: list = []
        if self._mode == "probe":
            if self._probe.feed(text):
                return out
            self._mode = "text"                        # it cannot be a bare call: read it as text
        while self._step(out):
            pass
        return out

    def finish(self) -> list:
        """The reply is whole: what was held back is decided."""
        out: list = []
        mode, rest, frame = self._mode, self._buf, self._frame
        self._buf, self._mode = "", "text"
        if mode == "probe":
            calls = whole_reply_calls(rest, self.names, self.fmt.id_style) if rest.strip() else None
            self._whole(calls, rest, out)
        elif mode == "text":
            self._text(rest, out)
        elif mode in ("head", "held"):                 # an unclosed frame that never was a call: text
            self._text(frame.open + rest, out)
        elif mode == "rest":
            self._whole(frame.parse(rest, self.names, self.fmt.id_style), frame.open + rest, out)
        elif mode == "args":
            self.incomplete = True
        if not self.calls and self._ws:                # a reply without calls keeps its text exactly
            out.append(("content", self._ws))
            self.content += self._ws
        self._ws = ""
        return out

    # ---- one step of the state machine; False when it needs more text ----
    def _step(self, out: list) -> bool:
        buf, mode = self._buf, self._mode
        if mode == "text":
            return self._in_text(buf, out)
        if mode == "head":
            return self._in_head(buf, out)
        if mode == "args":
            end = self._scan(buf)
            self._args(buf[:end], out)
            self._buf = buf[end:]
            if self._depth == 0:
                self._mode = "tail"
                return True
            return False
        if mode == "rest":
            return False
        close = self._frame.close                      # tail or held: up to the frame's close
        i = buf.find(close)
        if i < 0:
            return False
        block, self._buf, self._mode = buf[:i], buf[i + len(close):], "text"
        if mode == "held":
            self._whole(self._frame.parse(block, None, self.fmt.id_style), self._frame.open + block + close, out)
        return True

    def _in_text(self, buf: str, out: list) -> bool:
        hits = [(buf.find(f.open), f) for f in self.fmt.frames]
        hits = [(i, f) for i, f in hits if i >= 0]
        if hits:
            i, frame = min(hits, key=lambda h: h[0])
            self._text(buf[:i], out)
            self._buf, self._frame = buf[i + len(frame.open):], frame
            self._mode = "head" if frame.close else "rest"
            return True
        hold = marker_suffix(buf, self.fmt.markers)
        self._text(buf[:len(buf) - hold], out)
        self._buf = buf[len(buf) - hold:]
        return False

    def _in_head(self, buf: str, out: list) -> bool:
        got = _call_head(buf)
        if got is None:
            return False
        if got is False:
            self._mode = "held"
            return True
        name, j = got
        call = {"id": call_id(self.fmt.id_style), "type": "function", "function": {"name": name, "arguments": ""}}
        self.calls.append(call)
        out.append(("call", len(self.calls) - 1, {**call, "function": dict(call["function"])}))
        self._buf, self._mode = buf[j:], "args"
        self._depth, self._in_str, self._esc = 1, False, False
        self._args("{", out)
        return True

    def _whole(self, calls: Optional[list], text: str, out: list) -> None:
        """Calls read whole (each: its call event, then its arguments at once), or the text."""
        if not calls:
            self._text(text, out)
            return
        for call in calls:
            self.calls.append(call)
            i = len(self.calls) - 1
            out.append(("call", i, {**call, "function": {**call["function"], "arguments": ""}}))
            if call["function"]["arguments"]:
                out.append(("args", i, call["function"]["arguments"]))

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


def _call_head(buf: str):
    """A frame's start `{"name": "<name>", "arguments": {`: (name, index after the brace); None:
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
            end = string_end(rest)
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
