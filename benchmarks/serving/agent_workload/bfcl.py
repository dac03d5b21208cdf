"""BFCL tool calling, case by case: BFCL's functions as OpenAI tools (tool_choice auto,
parallel_tool_calls true, temperature 0), the reply's tool_calls AST-checked against
possible_answer (benchmarks/lib/bfcl_check.py)."""
from __future__ import annotations

import statistics
from pathlib import Path
from typing import TYPE_CHECKING, List

from benchmarks.lib.chat_client import chat

if TYPE_CHECKING:
    from benchmarks.serving.agent_workload.servers import Server
    from benchmarks.serving.agent_workload.store import Store

CONTENT_CHARS = 2000          # the reply's text kept per case (what the server did not read as calls)


def run_bfcl(server: Server, store: Store, category: str, cases: List[dict], args) -> None:
    """The category's cases not yet in the cell, one request each, then the cell's summary."""
    from benchmarks.lib.bfcl_check import to_openai_tools
    cell = store.cell(server.name, server.model, f"bfcl_{category}")
    done = cell.setdefault("cases", {})
    for c in cases:
        if c["id"] in done:
            continue
        body = {"model": Path(str(server.model)).name, "messages": c["messages"],
                "tools": to_openai_tools(c["functions"]), "tool_choice": "auto", "parallel_tool_calls": True,
                "temperature": 0, "max_tokens": args.bfcl_tokens}
        r = chat(server.url, body, args.timeout)
        done[c["id"]] = record(r, c)
        store.save()
        rec = done[c["id"]]
        print(f"{server.name} {server.model} {category} {c['id']}: {'pass' if rec['ok'] else rec['why']}", flush=True)
    summarise(cell, cases)
    cell["done"] = True
    store.save()


def record(r: dict, case: dict) -> dict:
    """One case's answer (chat()'s result) as the cell keeps it: the calls, the verdict, the reply's text."""
    from benchmarks.lib.bfcl_check import calls_of, check_case
    rec = {"s": round(r["s"], 3)}
    if r["status"] != 200 or "json" not in r:
        return {**rec, "ok": False, "why": f"HTTP {r['status']}: {(r.get('json') or r.get('text'))!s:.200}"}
    choice = r["json"]["choices"][0]
    msg, usage = choice.get("message") or {}, r["json"].get("usage") or {}
    calls, why = calls_of(msg, case["functions"])
    why = why or check_case(calls, case["functions"], case["ground_truth"], case["id"])
    return {**rec, "ok": why is None, "why": why, "calls": [[n, a] for n, a in calls],
            "content": (msg.get("content") or "")[:CONTENT_CHARS], "finish": choice.get("finish_reason"),
            "completion_tokens": usage.get("completion_tokens"), "prompt_tokens": usage.get("prompt_tokens")}


def rescore(cell: dict, cases: List[dict]) -> int:
    """The cell's stored calls checked again by the current checker (the calls are what the server
    returned; only the verdicts change); -> how many verdicts changed."""
    from benchmarks.lib.bfcl_check import NO_CALLS, check_case
    by_id, changed = {c["id"]: c for c in cases}, 0
    for cid, rec in cell.get("cases", {}).items():
        c = by_id.get(cid)
        if c is None or "calls" not in rec:
            continue
        calls = [(n, a) for n, a in rec["calls"]]
        why = check_case(calls, c["functions"], c["ground_truth"], cid) if calls else NO_CALLS
        changed += (why is None) != rec["ok"]
        rec.update(ok=why is None, why=why)
    if cell.get("done"):
        summarise(cell, cases)
    return changed


def summarise(cell: dict, cases: List[dict]) -> None:
    from benchmarks.lib.bfcl_check import NO_CALLS
    recs = [cell["cases"][c["id"]] for c in cases if c["id"] in cell.get("cases", {})]
    if not recs:
        return
    cell["summary"] = {"n": len(recs), "passed": sum(r["ok"] for r in recs),
                       "accuracy": sum(r["ok"] for r in recs) / len(recs),
                       "no_calls": sum(r.get("why") == NO_CALLS for r in recs),
                       "http_errors": sum(str(r.get("why", "")).startswith("HTTP") for r in recs),
                       "median_s": statistics.median(r["s"] for r in recs)}
