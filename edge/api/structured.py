"""Structured output: a request's `response_format` -> the grammar its generation follows.

{"type": "text"} (or none) is plain text; {"type": "json_object"} any JSON object;
{"type": "json_schema", "json_schema": {"name", "schema", "strict"}} JSON that follows the schema
(llguidance's JSON schema support; a schema it cannot compile is a 400 naming response_format,
as is one whose grammar passes the size cap). The generation masks the target's distribution
with the grammar, under speculation too, so the text is exactly the target's constrained text
(edge/speculative/constrained.py); through the star the draft service proposes under the same grammar.
"""
from __future__ import annotations

import json
import threading
from collections import OrderedDict
from typing import Optional

from edge.api.request_fields import BadRequest
from edge.speculative.grammar import (JSON_OBJECT, Grammar, GrammarError, grammar_from_json_schema, grammar_from_lark,
                               grammar_tokenizer)

KEEP_COMPILED = 32       # grammars kept compiled per endpoint (agents repeat their schemas)
PARAM = "response_format"


def response_schema(fmt) -> Optional[dict]:
    """The JSON schema a response_format asks for (None: plain text); BadRequest if malformed."""
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or not isinstance(fmt.get("type"), str):
        raise BadRequest("'response_format' must be an object such as {\"type\": \"json_object\"}", PARAM)
    kind = fmt["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return JSON_OBJECT
    if kind != "json_schema":
        raise BadRequest(f"'response_format.type' must be text, json_object or json_schema, got {kind[:40]!r}",
                         PARAM)
    spec = fmt.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
        raise BadRequest("'response_format.json_schema' must be an object {name, schema, strict} with the schema "
                         "as a JSON object", PARAM)
    return spec.get("schema") or JSON_OBJECT    # no schema: any JSON object, as OpenAI


class StructuredOutput:
    """One endpoint's grammars: its tokenizer for grammars (built on first use) and the compiled
    grammars kept by schema text."""

    def __init__(self, tokenizer):
        self.tok = tokenizer
        self._llg_tok = None
        self._compiled: "OrderedDict[str, Grammar]" = OrderedDict()
        self._lock = threading.Lock()

    def grammar_for(self, body: dict) -> Optional[Grammar]:
        """The grammar `body`'s response_format asks for, or None; BadRequest for what cannot be served."""
        schema = response_schema(body.get(PARAM))
        if schema is None:
            return None
        return self._compile("schema:" + json.dumps(schema, sort_keys=True), PARAM,
                             lambda: grammar_from_json_schema(schema))

    def grammar_for_lark(self, lark: str, param: str) -> Grammar:
        """A Lark grammar's (a forced tool_choice's, edge/api/tools.py); BadRequest naming `param`."""
        return self._compile("lark:" + lark, param, lambda: grammar_from_lark(lark))

    def _compile(self, key: str, param: str, text_of) -> Grammar:
        with self._lock:
            g = self._compiled.get(key)
            if g is not None:
                self._compiled.move_to_end(key)
                return g
            try:
                g = Grammar(text_of(), self._tokenizer()).check()
            except GrammarError as e:
                raise BadRequest(f"{param!r}: {e}", param) from None
            self._compiled[key] = g
            while len(self._compiled) > KEEP_COMPILED:
                self._compiled.popitem(last=False)
            return g

    def _tokenizer(self):
        if self._llg_tok is None:
            self._llg_tok = grammar_tokenizer(self.tok)
        return self._llg_tok
