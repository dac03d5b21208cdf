"""What a family of chat templates is, for tool calls: the frames its calls come in (what the
streaming parser looks for), the grammar a forced tool_choice is held to, and how its call ids look.

A marker that the tokenizer has as one (added, special) token goes into a grammar as that token,
`<[id]>` -- llguidance cannot spell a special token's text out of ordinary tokens, and its mask
for such a text literal offers the special token that it then refuses (a generation that takes
it never moves on: the `<tool_call><tool_call>...` of issue #44).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Callable, Iterable, List, Optional, Tuple

# JSON laid out as json.dumps lays it out (the templates show calls that way): no free whitespace
LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclass(frozen=True)
class Frame:
    """Calls between `open` and `close` (close None: from `open` to the end of the reply).
    parse(payload, names, id_style) -> calls or None reads what is inside a frame that the
    streaming parser did not read as it came."""
    open: str
    close: Optional[str]
    parse: Callable[[str, Optional[Iterable[str]], str], Optional[List[dict]]]


@dataclass(frozen=True)
class ToolFormat:
    family: str                      # the registry's key (edge/api/tool_formats/__init__.py)
    frames: Tuple[Frame, ...]
    grammar: Callable                # grammar(plan: ToolRequest, tok) -> Lark text for a forced tool_choice
    lenient: bool = False            # bare / fenced JSON calls accepted (edge/api/tool_formats/lenient.py)
    id_style: str = "openai"         # openai: call_<hex>; alnum9: Mistral's
    keep: Tuple[str, ...] = ()       # marker tokens the reply's text keeps, special or not

    @property
    def markers(self) -> Tuple[str, ...]:
        return tuple(f.open for f in self.frames)


def marker(tok, text: str) -> str:
    """text as a Lark grammar term: its token <[id]> when the tokenizer has it as one token,
    else a string literal."""
    i = _token_id(tok, text)
    return f"<[{i}]>" if i is not None else json.dumps(text)


def _token_id(tok, text: str) -> Optional[int]:
    if tok is None:
        return None
    try:
        i = tok.token_to_id(text)
        return i if i is not None and list(tok.encode(text)) == [i] else None
    except (AttributeError, TypeError, ValueError):
        return None


def marker_ids(tok, texts: Iterable[str]) -> dict:
    """{token id: text} of the markers the tokenizer has as single tokens."""
    out = {}
    for t in texts:
        i = _token_id(tok, t)
        if i is not None:
            out[i] = t
    return out


def forced_functions(plan) -> List[dict]:
    """The functions a forced tool_choice allows, in the order the tools were offered."""
    return [t["function"] for t in plan.tools if t["function"]["name"] in plan.forced]


def call_json(plan, args_key: str = "arguments") -> str:
    """A Lark term: one call object {"name": <allowed>, args_key: <its parameters' schema>}."""
    variants = []
    for fn in forced_functions(plan):
        params = fn.get("parameters") or {"type": "object"}
        variants.append({"type": "object", "properties": {"name": {"const": fn["name"]}, args_key: params},
                         "required": ["name", args_key], "additionalProperties": False})
    schema = {"anyOf": variants} if len(variants) > 1 else variants[0]
    return "%json " + json.dumps({**schema, "x-guidance": LAYOUT})
