"""The run: model by model, server by server, the cells not yet in the result JSON; this process
(the clients) on the core the servers do not run on."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict

from benchmarks.lib.results import ROOT
from benchmarks.serving.agent_workload.bfcl import rescore, run_bfcl
from benchmarks.lib.chat_client import ServerGone, chat
from benchmarks.serving.agent_workload.concurrent import run_concurrent
from benchmarks.serving.agent_workload.interleaved import run_interleaved
from benchmarks.serving.agent_workload.multiturn import run_multiturn, system_prompt
from benchmarks.serving.agent_workload.options import args_of, part_keys
from benchmarks.serving.agent_workload.report import write_report
from benchmarks.serving.agent_workload.servers import free_port, make_server
from benchmarks.serving.agent_workload.store import Store


def machine() -> dict:
    from edge.telemetry.cpu_info import cpu_name
    return {"cpu": cpu_name(), "cpus": os.cpu_count(), "host": socket.gethostname()}


def code_version() -> str:
    """The commit the server started from (`-dirty`: with uncommitted edits in the tree, anyone's)."""
    p = subprocess.run(["git", "describe", "--always", "--dirty"], cwd=ROOT, capture_output=True, text=True)
    return p.stdout.strip() or "?"


def open_store(args) -> Store:
    """The result JSON, the cells --redo names dropped, this run recorded."""
    from benchmarks.lib.bfcl_check import checker_name
    store = Store(args.out.with_name(args.out.name + ".json"))
    d = store.data
    d.setdefault("machine", machine())
    if d["machine"]["cpu"] != machine()["cpu"]:
        d.setdefault("machines_resumed", []).append(machine())
    d["config"] = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    dropped = store.drop(args.redo) if args.redo else []
    d["runs"].append({"started": time.strftime("%Y-%m-%d %H:%M:%S"), "argv": sys.argv[1:],
                      "loadavg_at_start": os.getloadavg(), "dropped": dropped})
    d["ours_parallel"] = args.parallel
    d["checker"] = checker_name()
    store.save()
    if dropped:
        print(f"dropped {len(dropped)} cells to run again: {', '.join(dropped)}", flush=True)
    return store


def run(args) -> dict:
    from benchmarks.lib.bfcl_check import load_category
    from benchmarks.lib.datasets import mtbench_first_turns
    from benchmarks.speculative.native_spec import tools

    os.sched_setaffinity(0, {1 - args.server_core})   # the clients: off the servers' core
    store = open_store(args)
    d = store.data
    bin_dir: Dict[str, Path] = {}
    ctx = {"logdir": Path("/tmp") / f"agent_workload_logs_{args.out.name}",
           "bin_dir": lambda: bin_dir.setdefault("b", tools()),
           "cases": {c: load_category(c, args.cases) for c in args.categories},
           "prompts": mtbench_first_turns(max(args.clients * args.requests, 1)), "system": None}
    for key, cell in d["cells"].items():            # stored calls, verdicts by the current checker
        part = key.rsplit("|", 1)[-1]
        if part.startswith("bfcl_") and part[5:] in ctx["cases"] and rescore(cell, ctx["cases"][part[5:]]):
            print(f"{key}: verdicts changed under {d['checker']}", flush=True)
    store.save()
    port = args.port
    for model in args.models:
        for name in args.servers:
            if all(store.done(name, model, k) for k in part_keys(args)):
                continue
            port = free_port(port + 1)
            run_server(make_server(name, model, port, args, ctx), store, args, ctx)
    d["runs"][-1]["finished"] = time.strftime("%Y-%m-%d %H:%M:%S")
    store.save()
    write_report(store.data, args.out)
    return store.data


def run_server(server, store: Store, args, ctx: dict) -> None:
    """One server up, its cells not yet done, the server down (a failure is recorded, the run goes on)."""
    d, name, model = store.data, server.name, server.model
    print(f"starting {name} for {model}", flush=True)
    t0 = time.monotonic()
    try:
        server.start()
        d["servers"][f"{name}|{model}"] = {**server.describe(), "start_s": round(time.monotonic() - t0, 1),
                                           "code": code_version()}
        chat(server.url, {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 8,
                          "temperature": 0}, args.timeout)             # warm-up, not counted
        for key in part_keys(args):
            if store.done(name, model, key):
                continue
            load0 = os.getloadavg()
            run_part(server, store, key, args, ctx)
            store.cell(name, model, key)["loadavg"] = [load0, os.getloadavg()]
            store.save()
            write_report(store.data, args.out)
        if name == "ours-star":
            d["servers"][f"{name}|{model}"]["joined"] = server.joined()
    except (ServerGone, RuntimeError) as e:
        msg = f"{name} {model}: {e}"
        print("FAILED " + msg, flush=True)
        d.setdefault("errors", []).append({"at": time.strftime("%Y-%m-%d %H:%M:%S"), "error": msg[:2000]})
        store.save()
    finally:
        server.stop()


def run_part(server, store: Store, key: str, args, ctx: dict) -> None:
    if key in ("multiturn", "interleaved"):
        if ctx["system"] is None:
            from edge.model.tokenizer import Tokenizer
            ctx["system"] = system_prompt(args.prefix_tokens, Tokenizer.from_gguf(server.gguf))
        (run_multiturn if key == "multiturn" else run_interleaved)(server, store, ctx["system"], args)
    elif key in ("concurrent", "serial"):
        run_concurrent(server, store, ctx["prompts"], args, args.np if server.name == "llama-server" else args.parallel,
                       part=key)
    else:
        category = key[len("bfcl_"):]
        run_bfcl(server, store, category, ctx["cases"][category], args)


def main(argv=None) -> None:
    args = args_of(argv)
    # stopped by SIGTERM or SIGINT (a nohup'd run ignores SIGINT unless told): leave through the
    # finally blocks, which stop the servers, the hub, the draft service and the broker
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    signal.signal(signal.SIGINT, signal.default_int_handler)
    run(args)
    print(args.out.with_name(args.out.name + ".md").read_text())
