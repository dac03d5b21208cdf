"""BFCL's function-calling cases as OpenAI `tools`, and an AST check of the calls a server returns.

The data is the bfcl-eval package's (installed without its dependencies): the questions in
bfcl_eval/data/BFCL_v4_<file>.json and the allowed answers in bfcl_eval/data/possible_answer/,
one JSON object a line. Three categories: simple (BFCL_v4_simple_python: one function, one call),
multiple (several functions offered, one call to the right one) and parallel (one function,
several calls, in any order).

A call matches a ground-truth entry (BFCL's ast_checker, for Python cases) when:

* the function name is the entry's (BFCL's dotted names are sent as OpenAI-valid names, "." -> "_",
  and mapped back, as BFCL does for OpenAI-style models);
* every required parameter is present and no parameter is unknown to the function;
* every argument has the parameter's type (an integer where a float is asked is fine; a float
  where an integer is asked is not) and its value is among the allowed values: strings compared
  after BFCL's standardisation (lowercase, without spaces and `,./-_*^`), lists element by element,
  nested dicts key by key with their own allowed values;
* a parameter the call leaves out has "" among its allowed values (optional).

A case passes when the call count is the ground truth's and every ground-truth entry is matched
by a distinct call (parallel: in any order). A reply with no parseable tool calls fails (score 0).
"""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Dict, List, Optional, Tuple

CATEGORIES = {"simple": "BFCL_v4_simple_python.json", "multiple": "BFCL_v4_multiple.json",
              "parallel": "BFCL_v4_parallel.json"}
TYPES = {"dict": "object", "float": "number", "tuple": "array"}     # BFCL's Python types -> JSON Schema


def data_dir() -> Path:
    import bfcl_eval
    return Path(bfcl_eval.__file__).parent / "data"


def load_category(category: str, n: Optional[int] = None) -> List[dict]:
    """n cases of a category, evenly spaced over its file (all of them when n is None or larger):
    each {"id", "messages", "functions", "ground_truth"}."""
    name = CATEGORIES[category]
    qs = [json.loads(ln) for ln in (data_dir() / name).read_text().splitlines() if ln.strip()]
    answers = {a["id"]: a["ground_truth"] for a in
               (json.loads(ln) for ln in (data_dir() / "possible_answer" / name).read_text().splitlines()
                if ln.strip())}
    if n is not None and n < len(qs):
        qs = [qs[(i * len(qs)) // n] for i in range(n)]
    return [{"id": q["id"], "messages": q["question"][0], "functions": q["function"],
             "ground_truth": answers[q["id"]]} for q in qs]


def tool_name(name: str) -> str:
    """An OpenAI-valid function name (^[a-zA-Z0-9_-]+$) for a BFCL name: dots become underscores."""
    return re.sub(r"[^a-zA-Z0-9_-]", "_", name)


def _schema(p: dict) -> dict:
    """A BFCL parameter schema in JSON Schema terms: dict -> object, float -> number, tuple -> array,
    any -> no type; nested properties and items converted alike."""
    out = {}
    for k, v in p.items():
        if k == "type":
            if v != "any":
                out[k] = TYPES.get(v, v)
        elif k == "properties" and isinstance(v, dict):
            out[k] = {name: _schema(s) for name, s in v.items()}
        elif k == "items" and isinstance(v, dict):
            out[k] = _schema(v)
        else:
            out[k] = v
    return out


def to_openai_tools(functions: List[dict]) -> List[dict]:
    """BFCL function descriptions as the `tools` of an OpenAI chat request."""
    return [{"type": "function", "function": {"name": tool_name(f["name"]), "description": f.get("description", ""),
                                              "parameters": _schema(f.get("parameters", {"type": "dict"}))}}
            for f in functions]


def calls_of(message: dict, functions: List[dict]) -> Tuple[List[Tuple[str, object]], Optional[str]]:
    """The (BFCL name, arguments) of an OpenAI response message's tool_calls, and why none could be
    read (None when they could). Arguments that are not a JSON object are kept as they are (they fail)."""
    back = {tool_name(f["name"]): f["name"] for f in functions}
    calls = []
    for tc in message.get("tool_calls") or []:
        fn = tc.get("function") or {}
        raw = fn.get("arguments")
        try:
            args = json.loads(raw) if isinstance(raw, str) else raw
        except ValueError:
            args = raw
        calls.append((back.get(fn.get("name"), fn.get("name")), args))
    if not calls:
        return [], "no tool calls in the reply"
    return calls, None


def standardize(s: str) -> str:
    """BFCL's string normalisation before comparing."""
    return re.sub(r"[ ,./\-_*^]", "", s).lower().replace("'", '"')


def _type_ok(value, bfcl_type: Optional[str]) -> bool:
    if bfcl_type in (None, "any"):
        return True
    if bfcl_type == "integer":
        return isinstance(value, int) and not isinstance(value, bool)
    if bfcl_type in ("float", "number"):
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if bfcl_type == "string":
        return isinstance(value, str)
    if bfcl_type == "boolean":
        return isinstance(value, bool)
    if bfcl_type in ("array", "tuple"):
        return isinstance(value, list)
    if bfcl_type == "dict":
        return isinstance(value, dict)
    return True


def _equal(value, allowed, schema: dict) -> bool:
    """One value against one allowed value (schema: the parameter's BFCL schema, for nested parts)."""
    if isinstance(allowed, bool) or isinstance(value, bool):
        return isinstance(allowed, bool) and isinstance(value, bool) and value == allowed
    if isinstance(allowed, str):
        return isinstance(value, str) and standardize(value) == standardize(allowed)
    if isinstance(allowed, (int, float)):
        return isinstance(value, (int, float)) and value == allowed
    if isinstance(allowed, list):
        items = schema.get("items") or {}
        return isinstance(value, list) and len(value) == len(allowed) and \
            all(_equal(v, a, items) for v, a in zip(value, allowed))
    if isinstance(allowed, dict):
        if not isinstance(value, dict):
            return False
        props = schema.get("properties") or {}
        for k, v in value.items():
            if k not in allowed:
                return False
            options = allowed[k] if isinstance(allowed[k], list) else [allowed[k]]
            if not _among(v, options, props.get(k, {})):
                return False
        return all("" in (a if isinstance(a, list) else [a]) for k, a in allowed.items() if k not in value)
    return value == allowed


def _among(value, options: list, schema: dict) -> bool:
    return any(_equal(value, a, schema) for a in options if a != "")


def check_call(name: str, args, function: dict, expected: Dict[str, list]) -> Optional[str]:
    """None when the call (name, args) matches the ground-truth entry `expected` ({param: allowed
    values}) for `function` (its BFCL description); else why not."""
    if name != function["name"]:
        return f"called {name!r}, expected {function['name']!r}"
    if not isinstance(args, dict):
        return f"arguments are not a JSON object: {str(args)[:80]!r}"
    params = function.get("parameters", {})
    props = params.get("properties", {})
    for r in params.get("required", []):
        if r not in args:
            return f"required parameter {r!r} missing"
    for k, v in args.items():
        if k not in props:
            return f"unknown parameter {k!r}"
        if k not in expected:
            return f"parameter {k!r} is not in the answer"
        t = props[k].get("type")
        if not _type_ok(v, t):
            return f"parameter {k!r}: {type(v).__name__} where {t} is asked"
        if not _among(v, expected[k], props[k]):
            return f"parameter {k!r}: {json.dumps(v)[:60]} not among {json.dumps(expected[k])[:80]}"
    for k, allowed in expected.items():
        if k not in args and "" not in allowed:
            return f"parameter {k!r} missing (not optional here)"
    return None


def check_case(calls: List[Tuple[str, object]], functions: List[dict], ground_truth: List[dict]) -> Optional[str]:
    """None when the calls answer the case: as many calls as ground-truth entries, each entry matched
    by a distinct call (any order); else why not (the first reason met)."""
    if len(calls) != len(ground_truth):
        return f"{len(calls)} calls, expected {len(ground_truth)}"
    by_name = {f["name"]: f for f in functions}
    free = list(range(len(calls)))
    for entry in ground_truth:
        (fname, expected), = entry.items()
        function = by_name.get(fname)
        if function is None:
            return f"the answer names {fname!r}, not offered"
        why = None
        for i in free:
            why = check_call(calls[i][0], calls[i][1], function, expected)
            if why is None:
                free.remove(i)
                break
        else:
            return why or "no call left"
    return None
