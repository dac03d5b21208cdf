"""Tool-call formats, one module per family of chat templates, chosen by the model's template.

    family   module     the calls as the model writes them
    qwen     hermes     <tool_call>{json}</tool_call>; also bare / fenced ```json calls (the whole reply)
    hermes   hermes     <tool_call>{json}</tool_call> (Hermes 2 Pro; any template that shows <tool_call>)
    llama3   llama3     bare {"name", "parameters"} (the whole reply); <|python_tag|>...
    mistral  mistral    [TOOL_CALLS][{json}, ...]; [TOOL_CALLS]name[ARGS]{json}

`detect(tok)` reads the family off the tokenizer's chat template (and vocabulary); a template it
does not know is read as hermes, the form the endpoint always parsed. edge/api/tool_formats/
stream.py is the one parser (streamed and whole), edge/api/tools.py the API over it.
"""
from __future__ import annotations

from edge.api.tool_formats.frame import Frame, ToolFormat
from edge.api.tool_formats.hermes import HERMES, QWEN, is_qwen
from edge.api.tool_formats.llama3 import LLAMA3, is_llama3
from edge.api.tool_formats.mistral import MISTRAL

__all__ = ["FAMILIES", "Frame", "ToolFormat", "detect"]

FAMILIES = {f.family: f for f in (QWEN, HERMES, LLAMA3, MISTRAL)}


def detect(tok) -> ToolFormat:
    """The tool-call format of the model whose tokenizer (and chat template) tok is."""
    template = getattr(tok, "chat_template", None) or ""
    if "[TOOL_CALLS]" in template:
        return MISTRAL
    if "<tool_call>" in template:
        return QWEN if is_qwen(template, tok) else HERMES
    if is_llama3(template):
        return LLAMA3
    return HERMES
