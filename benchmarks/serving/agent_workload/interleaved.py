"""Interleaved conversations: --conversations sessions, each with its own ~1,800-token system prompt (the
multi-turn one behind a line naming the conversation, so no two share more than a few tokens), their
turns round-robin -- turn t of every conversation, then turn t+1 -- so a conversation's next turn comes
after all the others': more conversations than a server holds in its slots (ours: --prompt-cache 4;
llama-server: -np 4), as a server for many users, or a coding agent's sub-agents, sees them. TTFT per
turn (the median over the conversations) and the prompt tokens reused: what a server keeps beyond its
slots (llama-server's --cache-ram, ours' --prompt-cache-ram) decides whether turns 2 and 3 prefill
everything again. Resumes turn by turn from the store."""
from __future__ import annotations

import statistics
from pathlib import Path
from typing import TYPE_CHECKING

from benchmarks.lib.chat_client import chat_stream
from benchmarks.serving.agent_workload.multiturn import TURNS
from benchmarks.serving.agent_workload.store import median_of

if TYPE_CHECKING:
    from benchmarks.serving.agent_workload.servers import Server
    from benchmarks.serving.agent_workload.store import Store

INTERLEAVED_TURNS = 3


def _messages(system: str, c: int, turns: list) -> list:
    """Conversation c's messages before its next turn: the system prompt, then each turn so far."""
    msgs = [{"role": "system", "content": f"Conversation {c + 1} of the review queue.\n" + system}]
    for t, done in enumerate(turns):
        msgs += [{"role": "user", "content": TURNS[t]}, {"role": "assistant", "content": done["answer"]}]
    return msgs + [{"role": "user", "content": TURNS[len(turns)]}]


def run_interleaved(server: Server, store: Store, system: str, args) -> None:
    cell = store.cell(server.name, server.model, "interleaved")
    convs = cell.setdefault("conversations", [])
    convs += [{"turns": []} for _ in range(args.conversations - len(convs))]
    for t in range(INTERLEAVED_TURNS):
        for c, conv in enumerate(convs):
            if len(conv["turns"]) > t:
                continue                  # done in an earlier run
            r = chat_stream(server.url, {"model": Path(str(server.model)).name, "temperature": 0,
                                         "messages": _messages(system, c, conv["turns"]),
                                         "max_tokens": args.turn_tokens}, args.timeout)
            if r["status"] != 200:
                raise RuntimeError(f"{server.name}: conversation {c + 1} turn {t + 1} answered {r['status']}: "
                                   f"{r.get('error')}")
            conv["turns"].append({k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items()
                                  if k not in ("content", "status")} | {"answer": r["content"]})
            print(f"{server.name} {server.model} conversation {c + 1} turn {t + 1}: ttft {r['ttft_s']}, "
                  f"cached {r.get('cached_tokens')} of {r.get('prompt_tokens')}", flush=True)
            store.save()
    turns = range(INTERLEAVED_TURNS)
    cell["summary"] = {
        "conversations": len(convs),
        "ttft_s": [median_of([cv["turns"][t]["ttft_s"] for cv in convs]) for t in turns],
        "prompt_tokens": [median_of([cv["turns"][t].get("prompt_tokens") for cv in convs]) for t in turns],
        "cached_tokens": [median_of([cv["turns"][t].get("cached_tokens") for cv in convs]) for t in turns],
        "total_s": sum(tt["total_s"] for cv in convs for tt in cv["turns"]),
        "turn_s_median": statistics.median(tt["total_s"] for cv in convs for tt in cv["turns"])}
    cell["done"] = True
    store.save()
