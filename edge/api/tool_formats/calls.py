"""What every family's parser shares: a call's id, a parsed JSON object -> an OpenAI tool call,
and the small JSON scanners the streaming parsers use."""
from __future__ import annotations

import json
import random
import string
import uuid
from typing import Iterable, Optional

# the keys a call object may carry: {name, arguments | parameters}, llama 3.x's "type": "function",
# Mistral's id, and the OpenAI shape {"type": "function", "function": {name, arguments}} a small
# model sometimes copies from the tool list
CALL_KEYS = frozenset({"name", "arguments", "parameters", "type", "id", "function"})
_ALNUM = string.ascii_letters + string.digits


def call_id(style: str = "openai") -> str:
    """A new call id: OpenAI's call_<24 hex>, or Mistral's 9 letters and digits (its templates
    refuse any other id when the call is sent back)."""
    if style == "alnum9":
        return "".join(random.choice(_ALNUM) for _ in range(9))
    return "call_" + uuid.uuid4().hex[:24]


def make_call(obj, names: Optional[Iterable[str]] = None, style: str = "openai") -> Optional[dict]:
    """An OpenAI tool call ({id, type, function: {name, arguments: JSON text}}) from a parsed call
    object, or None when obj is not one. names: the offered tools the name must be one of (None:
    any name, as an explicit call frame such as <tool_call> allows)."""
    if not isinstance(obj, dict) or not set(obj) <= CALL_KEYS:
        return None
    if "function" in obj:                                  # {"type": "function", "function": {...}}
        if set(obj) - {"type", "id", "function"} or obj.get("type", "function") != "function":
            return None
        fn = obj["function"]
        if not isinstance(fn, dict) or set(fn) - {"name", "arguments", "parameters"}:
            return None
        obj = {**fn, **({"id": obj["id"]} if "id" in obj else {})}
    name = obj.get("name")
    if not isinstance(name, str) or not name or (names is not None and name not in set(names)):
        return None
    if obj.get("type", "function") != "function" or ("arguments" in obj and "parameters" in obj):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):                              # arguments already as JSON text
        try:
            if not isinstance(json.loads(args), dict):
                return None
        except ValueError:
            return None
    elif isinstance(args, dict):
        args = json.dumps(args, ensure_ascii=False)
    else:
        return None
    given = obj.get("id")
    cid = given if style == "alnum9" and isinstance(given, str) and len(given) == 9 and given.isalnum() \
        else call_id(style)
    return {"id": cid, "type": "function", "function": {"name": name, "arguments": args}}


def make_calls(value, names=None, style: str = "openai") -> Optional[list]:
    """The calls of a parsed JSON value: one call object or a non-empty list of them; None when
    any part of it is not a call (all or nothing)."""
    items = value if isinstance(value, list) else [value]
    calls = [make_call(v, names, style) for v in items]
    return calls if calls and all(calls) else None


def values_calls(values: list, style: str = "openai") -> Optional[list]:
    """The calls of several parsed JSON values, one after another (any function name); None when
    any of them is not a call (all or nothing)."""
    calls = []
    for v in values:
        got = make_calls(v, None, style)
        if got is None:
            return None
        calls += got
    return calls


def json_values(text: str) -> Optional[list]:
    """The JSON values text is made of, one after another (whitespace between them, or `;` as
    llama 3.x separates calls); None when anything else is in it."""
    dec, out, i, n = json.JSONDecoder(), [], 0, len(text)
    while True:
        while i < n and text[i] in " \t\r\n;":
            if text[i] == ";" and not out:
                return None
            i += 1
        if i >= n:
            return out or None
        try:
            value, i = dec.raw_decode(text, i)
        except ValueError:
            return None
        out.append(value)


def string_end(text: str) -> Optional[int]:
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


def marker_suffix(text: str, markers: Iterable[str]) -> int:
    """The length of text's longest suffix that may be the start of one of the markers."""
    best = 0
    for m in markers:
        for n in range(min(len(m) - 1, len(text)), best, -1):
            if text.endswith(m[:n]):
                best = n
                break
    return best
