"""Llama 3.1 / 3.2 / 3.3: a custom tool's call is the bare JSON {"name": ..., "parameters": {...}}
(llama 3.2 may write several, separated by `;`), the whole reply; a built-in tool's is
<|python_tag|>name.call(key=value, ...), and <|python_tag|> before code calls the code tool.
<|python_tag|> is a special token (skipped when decoding): the endpoint keeps it in the text.
A forced tool_choice is held to the bare JSON form, "parameters" as the template asks.
"""
from __future__ import annotations

import ast
import json
import re
from typing import Iterable, List, Optional

from edge.api.tool_formats.calls import call_id, json_values, values_calls
from edge.api.tool_formats.frame import Frame, ToolFormat, call_json

TAG = "<|python_tag|>"
_BUILTIN = re.compile(r"\s*([A-Za-z_][A-Za-z0-9_]*)\.call\((.*)\)\s*\Z", re.S)
CODE_TOOLS = ("python", "code_interpreter", "ipython")


def parse_tagged(payload: str, names: Optional[Iterable[str]] = None, style: str = "openai") -> Optional[List[dict]]:
    """What follows <|python_tag|>: JSON call(s), a built-in's name.call(k=v, ...), or code for
    the code tool when one is offered."""
    values = json_values(payload)
    calls = None if values is None else values_calls(values, style)
    if calls is not None:
        return calls
    m = _BUILTIN.match(payload)
    if m is not None:
        args = _kwargs(m.group(2))
        if args is not None:
            return [_call(m.group(1), args, style)]
    code = next((n for n in CODE_TOOLS if names is not None and n in set(names)), None)
    if code is not None and payload.strip():
        return [_call(code, {"code": payload.strip()}, style)]
    return None


def _kwargs(text: str) -> Optional[dict]:
    """key=literal, ... as a dict (None when it is not that)."""
    try:
        node = ast.parse(f"f({text})", mode="eval").body
        if not isinstance(node, ast.Call) or node.args:
            return None
        return {k.arg: ast.literal_eval(k.value) for k in node.keywords if k.arg is not None}
    except (SyntaxError, ValueError):
        return None


def _call(name: str, args: dict, style: str) -> dict:
    return {"id": call_id(style), "type": "function",
            "function": {"name": name, "arguments": json.dumps(args, ensure_ascii=False)}}


def grammar(plan, tok) -> str:
    """The bare {"name": ..., "parameters": ...} -- several separated by "; " when parallel."""
    more = ' ("; " call)*' if plan.parallel else ""
    return f"start: call{more}\ncall: {call_json(plan, 'parameters')}\n"


LLAMA3 = ToolFormat("llama3", (Frame(TAG, None, parse_tagged),), grammar, lenient=True, keep=(TAG,))


def is_llama3(template: str) -> bool:
    return TAG in template or ("<|start_header_id|>" in template and
                               ("ipython" in template or '"parameters"' in template))
