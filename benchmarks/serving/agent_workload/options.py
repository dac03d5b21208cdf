"""The run's command line: what to run (models, servers, parts), how big, and where it writes."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import List

from benchmarks.lib.results import result_stem

SERVERS = ("llama-server", "ours", "ours-star")
MODELS = ("qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b")
CATEGORIES = ("simple", "multiple", "parallel")
PARTS = ("multiturn", "concurrent", "serial", "bfcl", "interleaved")   # the order they run in per server
DEFAULT_PARTS = PARTS[:4]                         # interleaved: asked for by name (interleaved.py)
TURNS = 5                                         # the session's user turns (multiturn.py has five)
DESCRIPTION = "Agent workloads on a device's OpenAI endpoint: ours (alone, through the star) vs llama-server."


def args_of(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.serving.agent_workload", description=DESCRIPTION)
    ap.add_argument("--models", default=",".join(MODELS), help="target models (names or GGUF paths), comma-separated")
    ap.add_argument("--servers", default=",".join(SERVERS), help=f"of {', '.join(SERVERS)}")
    ap.add_argument("--parts", default=",".join(DEFAULT_PARTS), help=f"of {', '.join(PARTS)}")
    ap.add_argument("--categories", default=",".join(CATEGORIES), help="BFCL categories")
    ap.add_argument("--cases", type=int, default=100, help="BFCL cases per category (evenly spaced)")
    ap.add_argument("--bfcl-tokens", type=int, default=512, help="max_tokens of a BFCL request")
    ap.add_argument("--turns", type=int, default=TURNS, help="user turns of the multi-turn session")
    ap.add_argument("--sessions", type=int, default=3, help="multi-turn sessions (medians)")
    ap.add_argument("--prefix-tokens", type=int, default=1800, help="the session's system prompt, in tokens")
    ap.add_argument("--turn-tokens", type=int, default=128, help="max_tokens of a session's turn")
    ap.add_argument("--conversations", type=int, default=8, help="the interleaved part's conversations")
    ap.add_argument("--prompt-cache-ram", type=float, default=None, metavar="MB",
                    help="ours' --prompt-cache-ram (alone and the star's target; default: the CLI's)")
    ap.add_argument("--clients", type=int, default=4, help="concurrent clients")
    ap.add_argument("--requests", type=int, default=4, help="requests per client, back to back")
    ap.add_argument("--concurrent-tokens", type=int, default=128, help="max_tokens of a concurrent request")
    ap.add_argument("--np", type=int, default=4, help="llama-server's -np (parallel slots)")
    ap.add_argument("--parallel", type=int, default=None,
                    help="ours' --parallel (generations at once, alone and through the star; default: --clients)")
    ap.add_argument("--gamma", default="auto", help="the star target's -g")
    ap.add_argument("--repack", choices=("auto", "on", "off", "both"), default="auto",
                    help="ours' (alone and the star's target) llama.cpp CPU weight repacking (edge-agent run "
                         "--repack; on: llama-server's weight layout); llama-server keeps its default (on)")
    ap.add_argument("--draft", default="qwen2.5-coder-0.5b", help="the star's draft model")
    ap.add_argument("--draft-format", default="Q4_0", help="the draft's GGUF format (export/target_format.py)")
    ap.add_argument("--server-core", type=int, choices=(0, 1), default=0,
                    help="the core the servers run on (the clients, hub and draft: the other); two runs of "
                         "different servers may share --out on different cores")
    ap.add_argument("--port", type=int, default=18400, help="first of the local ports the servers take")
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds one request may take")
    ap.add_argument("--redo", action="append", default=[], metavar="PATTERN",
                    help="drop the stored cells whose 'server|model|part' key matches (shell pattern, e.g. "
                         "'ours|*|concurrent' or 'ours*|*|bfcl_*') so they run again; repeatable")
    ap.add_argument("--quick", action="store_true",
                    help="a smoke run: 10 BFCL cases a category, the 0.5B only, 2 turns, 1 session, 1 request a client")
    ap.add_argument("--out", type=Path, default=None,
                    help="results path without suffix (default: .../agent_workload/default; --quick: smoke)")
    args = ap.parse_args(argv)
    if args.quick:
        given = set(a.split("=")[0] for a in (argv if argv is not None else sys.argv[1:]))
        for opt, value in (("--cases", 10), ("--models", MODELS[0]), ("--turns", 2), ("--sessions", 1),
                           ("--requests", 1)):
            if opt not in given:
                setattr(args, opt[2:].replace("-", "_"), value)
    args.out = args.out or result_stem("agent_workload", "smoke" if args.quick else "default")
    args.models = [m for m in args.models.split(",") if m]
    args.servers = [s for s in args.servers.split(",") if s]
    args.parts = [p for p in args.parts.split(",") if p]
    args.categories = [c for c in args.categories.split(",") if c]
    args.parallel = args.clients if args.parallel is None else args.parallel
    for name, values, allowed in (("--servers", args.servers, SERVERS), ("--parts", args.parts, PARTS),
                                  ("--categories", args.categories, CATEGORIES)):
        bad = [v for v in values if v not in allowed]
        if bad or not values:
            ap.error(f"{name}: {', '.join(bad) or 'none given'} (choose from {', '.join(allowed)})")
    if args.turns < 1 or args.turns > TURNS:
        ap.error(f"--turns: 1..{TURNS}")
    if min(args.cases, args.sessions, args.clients, args.requests, args.parallel, args.conversations) < 1:
        ap.error("--cases, --sessions, --clients, --requests, --parallel and --conversations must be at least 1")
    return args


def part_keys(args) -> List[str]:
    """The cells' part names a server runs for one model, in order."""
    keys = []
    for p in args.parts:
        keys += [f"bfcl_{c}" for c in args.categories] if p == "bfcl" else [p]
    return keys
