"""BFCL's function-calling cases as OpenAI `tools`, and BFCL's own AST check of the calls a server returns.

The data is the bfcl-eval package's (installed without its dependencies): the questions in
bfcl_eval/data/BFCL_v4_<file>.json and the allowed answers in bfcl_eval/data/possible_answer/,
one JSON object a line. Three categories: simple (BFCL_v4_simple_python: one function, one call),
multiple (several functions offered, one call to the right one) and parallel (one function,
several calls, in any order).

The check is bfcl-eval's own `ast_checker` (bfcl_eval/eval_checker/ast_eval/ast_checker.py), as
BFCL scores a Python-category model: names, required / unexpected / optional parameters, types
(an int where a float is asked is fine, nested list items typed), values among the allowed ones
(strings standardised: lowercase, without spaces and `,./-_*^`), dicts key by key, parallel calls
in any order. BFCL's dotted names are sent as OpenAI-valid names ("." -> "_") and mapped back
before the check. A reply with no tool calls the server parsed fails (score 0).
"""
from __future__ import annotations

import importlib
import json
import re
import sys
import types
from pathlib import Path
from types import SimpleNamespace
from typing import List, Optional, Tuple

CATEGORIES = {"simple": "BFCL_v4_simple_python.json", "multiple": "BFCL_v4_multiple.json",
              "parallel": "BFCL_v4_parallel.json"}
TYPES = {"dict": "object", "float": "number", "tuple": "array"}     # BFCL's Python types -> JSON Schema
MODEL = "starsun-openai-endpoint"    # the name BFCL's checker gets for the model (no "_": it reads "/" there)
NO_CALLS = "no tool calls in the reply"


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
        return [], NO_CALLS
    return calls, None


def checker_name() -> str:
    """What checks the calls, for the record."""
    from importlib.metadata import PackageNotFoundError, version
    try:
        return f"bfcl-eval {version('bfcl-eval')} ast_checker"
    except PackageNotFoundError:
        return "bfcl-eval ast_checker"


def standardize(s: str) -> str:
    """BFCL's string normalisation before comparing."""
    return _ast_checker().standardize_string(s)


def _ast_checker():
    """bfcl-eval's ast_checker module. It imports bfcl_eval.constants.model_config, BFCL's registry
    of the models it runs, which imports every vendor's SDK (anthropic, ...: not installed with
    --no-deps); of it the checker only reads whether a model's function names had their dots
    turned into underscores. Where that registry cannot be imported, a stand-in with our one
    entry takes its place (dots kept: calls_of has mapped the sent names back)."""
    name = "bfcl_eval.constants.model_config"
    registry = sys.modules.get(name)
    if registry is None:
        try:
            registry = importlib.import_module(name)
        except ImportError:
            registry = types.ModuleType(name)
            registry.MODEL_CONFIG_MAPPING = {}
            sys.modules[name] = registry
    registry.MODEL_CONFIG_MAPPING.setdefault(MODEL, SimpleNamespace(underscore_to_dot=False))
    from bfcl_eval.eval_checker.ast_eval import ast_checker
    return ast_checker


def _why(result: dict) -> str:
    """BFCL's verdict as one line: its error type, its first message and, for a parallel case, why
    the first call it tried did not match."""
    texts = [e for e in result.get("error") or [] if isinstance(e, str)]
    subs = [sub.get("sub_error") for e in result.get("error") or [] if isinstance(e, dict)
            for sub in e.values() if isinstance(sub, dict)]
    why = f"{result.get('error_type', 'invalid')}: {texts[0] if texts else '?'}"
    return why + (f" ({subs[0][0]})" if subs and subs[0] else "")


def check_case(calls: List[Tuple[str, object]], functions: List[dict], ground_truth: List[dict],
               category: str) -> Optional[str]:
    """None when the calls answer the case as BFCL's ast_checker judges a `category` case (simple,
    multiple or parallel); else why not (BFCL's error type and first error)."""
    for name, args in calls:
        if not isinstance(args, dict):
            return f"arguments of {name!r} are not a JSON object: {str(args)[:80]!r}"
    checker = _ast_checker()
    from bfcl_eval.constants.enums import Language
    output = [{name: args} for name, args in calls]
    try:
        result = checker.ast_checker(functions, output, ground_truth, Language.PYTHON, category, MODEL)
    except (KeyError, TypeError, AttributeError, ValueError) as e:    # a shape the checker does not expect
        return f"checker_error: {type(e).__name__}: {e}"[:300]
    if result.get("valid"):
        return None
    count = f" ({len(calls)} calls, expected {len(ground_truth)})" if len(calls) != len(ground_truth) else ""
    return _why(result) + count
