"""Issue 44's hostile schemas through the star (benchmarks/star/constrained_speed.py --hostile):
each compiled and checked as the API does at the door (Grammar.check: a GrammarError is its 400),
then, if it passes, answered through the star (greedy, 40 new tokens). The goal: each answered or
refused in under 5 s, and the star serving the next request (a plain boolean schema) after it.
tests/system/test_structured_output.py holds the same list against the endpoint (untimed)."""
from __future__ import annotations

import json
import time

HOSTILE = {
    "catastrophic regex": {"type": "string", "pattern": "^(a+)+(b+)+(a|aa)*c$"},
    "300-deep nesting": json.loads('{"type": "array", "items": ' * 300 + '{"type": "integer"}' + "}" * 300),
    "20,000-value enum": {"enum": [f"value-{i}" for i in range(20_000)]},
    "minItems 100000": {"type": "array", "items": {"const": 1}, "minItems": 100_000},
    "bad $ref": {"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}},
}
PROMPT = "Reply with JSON only."
GOAL_S = 5.0


def time_hostile(star, tok, gtok, stop_ids) -> list:
    """One row per schema: seconds to the answer or the refusal, which, and the next answer's."""
    from edge.speculative.grammar import Grammar, GrammarError, grammar_from_json_schema
    from edge.speculative.sampling import GREEDY
    ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": PROMPT}]))
    rows = []
    for name, schema in HOSTILE.items():
        t = time.perf_counter()
        try:
            grammar = Grammar(grammar_from_json_schema(schema), gtok).check()
            res = star.generate(ids, 40, GREEDY, stop_ids=stop_ids, grammar=grammar)
            outcome, detail = "answered", f"{res.n_generated} tokens ({res.finish_reason}), {res.n_forced} forced"
        except GrammarError as e:
            outcome, detail = "refused", str(e).splitlines()[0][:120]
        seconds = time.perf_counter() - t
        ok = Grammar(grammar_from_json_schema({"type": "boolean"}), gtok)
        text = tok.decode(star.generate(ids, 8, GREEDY, stop_ids=stop_ids, grammar=ok).tokens, skip_special=True)
        rows.append({"schema": name, "outcome": outcome, "seconds": seconds, "detail": detail,
                     "next_answer": text, "within_goal": seconds < GOAL_S})
        print(f"hostile {name}: {outcome} in {seconds:.2f} s ({detail}); next: {text!r}", flush=True)
    return rows


def hostile_lines(rows) -> list:
    """The report's section (empty when the run did not time them)."""
    if not rows:
        return []
    lines = ["", f"## Hostile schemas through the star (issue 44: answered or refused in < {GOAL_S:g} s)", "",
             "| schema | outcome | seconds | detail | the next request's answer |", "|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['schema']} | {r['outcome']} | {r['seconds']:.2f}{'' if r['within_goal'] else ' **over**'} "
                     f"| {r['detail']} | `{r['next_answer']}` |")
    return lines
