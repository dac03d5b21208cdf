"""Calls written without the family's call frame, as small Qwen models write them: a bare JSON
call object, a list of them, or either inside a fenced ```json block -- and llama 3.x's own form,
a bare {"name": ..., "parameters": ...}.

Such a reply is calls only when the WHOLE reply (modulo whitespace) is made of them and every name
is one of the offered tools: text that merely shows or mentions a call stays text. `Probe` says,
as the reply streams, whether the text so far can still be such a reply (the stream holds it back
while it can and lets it go as content the moment it cannot); `whole_reply_calls` decides at the end.
"""
from __future__ import annotations

import json
import re
from typing import Iterable, List, Optional

from edge.api.tool_formats.calls import CALL_KEYS, make_calls

_FENCE_HEAD = re.compile(r"```[A-Za-z_]*[ \t]*\n")
_WS = " \t\r\n"


def whole_reply_calls(text: str, names: Iterable[str], style: str = "openai") -> Optional[List[dict]]:
    """The calls when the whole of text is call objects / lists of them (bare or fenced, one or
    more, separated by whitespace or `;`) naming offered tools; else None."""
    names, calls, dec = set(names), [], json.JSONDecoder()
    i, n, fenced, after_value = 0, len(text), False, False
    while True:
        while i < n and (text[i] in _WS or (text[i] == ";" and after_value)):
            i += 1
        if i >= n:
            return calls if calls and not fenced else None
        if text.startswith("```", i):
            if fenced:
                i, fenced = i + 3, False
                continue
            m = _FENCE_HEAD.match(text, i)
            if m is None:
                return None
            i, fenced, after_value = m.end(), True, False
            continue
        if text[i] not in "{[":
            return None
        try:
            value, i = dec.raw_decode(text, i)
        except ValueError:
            return None
        got = make_calls(value, names, style)
        if got is None:
            return None
        calls += got
        after_value = True


class Probe:
    """Fed the reply's text, says whether it can still be a reply of calls (whole_reply_calls's
    shape): the top-level keys of each call object must be call keys and its "name" an offered
    tool (checked as it is written). False is final."""

    def __init__(self, names: Iterable[str]):
        self.names = sorted(set(names))
        self.alive = True
        self._state = "gap"          # gap | ticks | lang | json
        self._fenced = self._after_value = False
        self._ticks = 0
        self._stack: List[str] = []
        self._call_depth = 1         # the stack depth of a call object (2: inside a top-level list)
        self._slot = "value"         # in the call object: key | colon | value (what comes next)
        self._last_key: Optional[str] = None
        self._in_str = self._esc = False
        self._capture: Optional[str] = None
        self._str = ""

    def feed(self, text: str) -> bool:
        for ch in text:
            if not self.alive:
                break
            self.alive = self._char(ch)
        return self.alive

    def _char(self, ch: str) -> bool:
        if self._state == "json":
            return self._json(ch)
        if self._state == "ticks":
            if ch == "`" and self._ticks < 3:
                self._ticks += 1
                return True
            if self._ticks < 3:
                return False
            if self._fenced:                       # the fence closed
                self._fenced, self._state, self._after_value = False, "gap", False
                return self._char(ch)
            self._state = "lang"
        if self._state == "lang":
            if ch == "\n":
                self._fenced, self._state = True, "gap"
                return True
            return ch.isalpha() or ch in "_ \t"
        if ch in _WS or (ch == ";" and self._after_value):
            return True
        if ch == "`":
            self._state, self._ticks = "ticks", 1
            return True
        if ch in "{[":
            self._state, self._stack = "json", [ch]
            self._call_depth, self._slot = (1, "key") if ch == "{" else (2, "value")
            return True
        return False

    def _json(self, ch: str) -> bool:
        if self._in_str:
            return self._string(ch)
        depth = len(self._stack)
        at_call = depth == self._call_depth
        if ch == '"':
            if at_call and self._slot == "key":
                self._capture = "key"
            elif at_call and self._last_key == "name":
                self._capture = "name"
            else:
                self._capture = None
            self._in_str, self._esc, self._str = True, False, ""
            return True
        if depth == self._call_depth - 1 and ch not in _WS + ",]":
            if ch != "{":                          # a top-level list holds call objects only
                return False
        elif at_call and self._slot == "key" and ch not in _WS + "}":
            return False
        elif at_call and self._slot == "colon" and ch not in _WS + ":":
            return False
        if ch in "{[":
            self._stack.append(ch)
            if len(self._stack) == self._call_depth:
                self._slot, self._last_key = "key", None
        elif ch in "}]":
            if self._stack.pop() != ("{" if ch == "}" else "["):
                return False
            if not self._stack:
                self._state, self._after_value = "gap", True
        elif at_call and ch == ":":
            self._slot = "value"
        elif at_call and ch == ",":
            self._slot = "key"
        return True

    def _string(self, ch: str) -> bool:
        if self._esc:
            self._esc = False
        elif ch == "\\":
            self._esc = True
        elif ch == '"':
            self._in_str = False
            if self._capture == "key":
                try:
                    self._last_key = json.loads('"' + self._str + '"')
                except ValueError:
                    return False
                self._slot = "colon"
                return self._last_key in CALL_KEYS
            if self._capture == "name":
                return self._str in self.names
            return True
        self._str += ch if self._capture else ""
        if self._capture == "key":
            return any(k.startswith(self._str) for k in CALL_KEYS) or "\\" in self._str
        if self._capture == "name":
            return any(n.startswith(self._str) for n in self.names) or "\\" in self._str
        return True
