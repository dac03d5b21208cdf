"""Mistral: [TOOL_CALLS] then the calls to the end of the reply -- a JSON list
[{"name": ..., "arguments": {...}, "id": "a1b2c3d4e"}] (Mistral 7B v0.3, Nemo, Small), or
name[ARGS]{...} per call, each after its own [TOOL_CALLS] (tokenizer v11+, with
[CALL_ID]id before [ARGS] in later ones). The markers are special tokens (skipped when decoding):
the endpoint keeps them in the text. Call ids are 9 letters and digits, as the templates demand
of the calls sent back. A forced tool_choice is held to [TOOL_CALLS][{...}, ...].
"""
from __future__ import annotations

import json
import re
from typing import Iterable, List, Optional

from edge.api.tool_formats.calls import json_values, make_call, values_calls
from edge.api.tool_formats.frame import Frame, ToolFormat, call_json, marker

TOOL_CALLS, ARGS, CALL_ID = "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"
_NAMED = re.compile(r"\s*([A-Za-z0-9_.\-]{1,64})(?:\[CALL_ID\]([A-Za-z0-9]+))?\[ARGS\](.*)\Z", re.S)
STYLE = "alnum9"


def parse_tagged(payload: str, names: Optional[Iterable[str]] = None, style: str = STYLE) -> Optional[List[dict]]:
    """What follows [TOOL_CALLS]: a JSON list (or object) of calls, or name[ARGS]{...} calls
    separated by further [TOOL_CALLS]."""
    values = json_values(payload)
    if values is not None:
        return values_calls(values, style)
    calls = []
    for part in payload.split(TOOL_CALLS):
        m = _NAMED.match(part)
        if m is None:
            return None
        try:
            args = json.loads(m.group(3))
        except ValueError:
            return None
        call = make_call({"name": m.group(1), "arguments": args, **({"id": m.group(2)} if m.group(2) else {})},
                         None, style)
        if call is None:
            return None
        calls.append(call)
    return calls


def grammar(plan, tok) -> str:
    """[TOOL_CALLS][call] -- or [call, call, ...] when parallel."""
    more = ' (", " call)*' if plan.parallel else ""
    return f'start: {marker(tok, TOOL_CALLS)} "[" call{more} "]"\ncall: {call_json(plan)}\n'


MISTRAL = ToolFormat("mistral", (Frame(TOOL_CALLS, None, parse_tagged),), grammar, id_style=STYLE,
                     keep=(TOOL_CALLS, ARGS, CALL_ID))
