"""Hermes 2 Pro / Qwen2.5 / Qwen3: <tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>.

Qwen2.5's tokenizer has <tool_call> and </tool_call> as single added tokens (151657 / 151658);
the reply's text has them either way (they are not skipped when decoding), written as the token
or spelled out. The Qwen family's small models also answer with the call bare or in a fenced
```json block (edge/api/tool_formats/lenient.py): its format accepts those when they are the
whole reply. A forced tool_choice is held to the frame, its markers as the tokenizer's tokens.
"""
from __future__ import annotations

from typing import Iterable, List, Optional

from edge.api.tool_formats.calls import json_values, values_calls
from edge.api.tool_formats.frame import Frame, ToolFormat, call_json, marker

OPEN, CLOSE = "<tool_call>", "</tool_call>"


def parse_block(block: str, names: Optional[Iterable[str]] = None, style: str = "openai") -> Optional[List[dict]]:
    """The calls inside one <tool_call> block that the stream could not read as it came (keys in
    another order, arguments as a JSON string, "parameters", several objects): any name, since
    the frame says the model meant a call."""
    values = json_values(block)
    return None if values is None else values_calls(values, style)


def grammar(plan, tok) -> str:
    """One <tool_call> block -- or several, one per line, when parallel -- each one allowed
    function's call with arguments that follow its schema. The line break after the last block
    is allowed: Qwen2.5 writes one before it ends (without it, parallel calls would be all that
    the grammar left it, and it would repeat the call)."""
    call = f'{marker(tok, OPEN)} "\\n" {call_json(plan)} "\\n" {marker(tok, CLOSE)}'
    more = ' ("\\n" call)*' if plan.parallel else ""
    return f'start: call{more} "\\n"?\ncall: {call}\n'


FRAME = Frame(OPEN, CLOSE, parse_block)
HERMES = ToolFormat("hermes", (FRAME,), grammar, keep=(OPEN, CLOSE))
QWEN = ToolFormat("qwen", (FRAME,), grammar, lenient=True, keep=(OPEN, CLOSE))


def is_qwen(template: str, tok) -> bool:
    """A Qwen template or vocabulary (Qwen2.5 and Qwen3 have <|fim_pad|>)."""
    if "Qwen" in template:
        return True
    try:
        return tok.token_to_id("<|fim_pad|>") is not None
    except AttributeError:
        return False
