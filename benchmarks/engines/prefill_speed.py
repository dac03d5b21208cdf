"""Prefill speed: a long prompt through our endpoint vs llama-server, same GGUF, threads and cores (issue 44).

For each model (its Q4_K_M GGUF) and thread count, the servers are started side by side on the same
cores (taskset: one thread on core 0, two on cores 0-1): llama.cpp's `llama-server` (`make
llama-tools`, the llama.cpp vendored in the kit's llama-cpp-python; `-t N -tb N -np 1 -c CTX`, its
defaults otherwise: CPU weight repacking on) and ours (benchmarks/lib/agent_alone_worker.py: the
OpenAI endpoint `edge-agent run --role target` serves, target-only, its prompt cache on,
`--threads N`); for a K-quant GGUF, whose weights ours keeps unrepacked (faster prefill,
edge/engines/llamacpp_load.py), also `llama-server --no-repack`: the same weight layout and kernels
as ours. Rounds alternate the servers' order. A request is PROMPT prompt tokens (MT-bench text as
token ids, the first token different every request so that neither server reuses a prefix), one
completion token: ours /v1/completions, llama-server /completion with cache_prompt false.

Per request: prompt tokens / the request's wall time (both: what a client waits for), the server's
own `timings.prompt_per_second` (its prompt phase only; ours reports the same field), and prompt
tokens per CPU second of the server process (from /proc; at one thread the least disturbed by other work on a shared machine).
Medians over the rounds. `--threads default` starts both with no thread option on cores 0-1, plus
ours at `--threads 4` (llama.cpp's library default, what ours used before it chose one thread per
physical core). `--sweep MODELS` also times the engine alone (LlamaCppEngine.forward_last, the call the
endpoint's prefill makes) at each n_ubatch / flash-attention setting. `--parallel` adds 4
concurrent clients against ours at --parallel 1 and --parallel 4 (benchmarks/lib/prefill_parallel.py).

  python -m benchmarks.engines.prefill_speed [--models qwen2.5-coder-0.5b,qwen2.5-coder-1.5b]
      [--threads 1,2,default] [--tokens 2048] [--rounds 3] [--sweep MODELS] [--parallel] [--out PATH]
      [--no-same-layout]

Writes benchmarks/results/prefill_speed/<variant>.{json,md,png}; the JSON is written after every
cell and a rerun skips the cells it holds (resumable; --redo to measure again).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

from benchmarks.lib.prefill_servers import LlamaServer, OursServer, prompt_ids, sweep_engine, tools_bin
from benchmarks.lib.results import result_stem
from edge.telemetry.cpu_info import cpu_name

CORES = {"1": [0], "2": [0, 1], "default": [0, 1]}


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="qwen2.5-coder-0.5b,qwen2.5-coder-1.5b")
    ap.add_argument("--threads", default="1,2,default", help="thread counts; `default`: no thread option")
    ap.add_argument("--tokens", type=int, default=2048, help="prompt tokens a request")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--ctx", type=int, default=4096, help="context per sequence, both servers")
    ap.add_argument("--sweep", default="", metavar="MODELS",
                    help="also these models' engine alone at each n_ubatch / flash-attn setting")
    ap.add_argument("--parallel", action="store_true", help="also 4 clients vs ours --parallel 1 / 4 (0.5B)")
    ap.add_argument("--same-layout", action=argparse.BooleanOptionalAction, default=True,
                    help="also llama-server --no-repack where ours does not repack the GGUF's weights")
    ap.add_argument("--redo", action="store_true", help="measure the cells the JSON holds again")
    ap.add_argument("--out", type=Path, default=result_stem("prefill_speed"), help="results path without suffix")
    return ap.parse_args(argv)


def git_commit() -> str:
    """The kit's commit the cell ran at (a "+" when the code it runs had uncommitted changes)."""
    import subprocess

    def git(*a):
        return subprocess.run(["git", *a], capture_output=True, text=True, cwd=Path(__file__).parent).stdout.strip()
    code = ["edge", "benchmarks/lib", "benchmarks/engines"]
    return git("rev-parse", "--short", "HEAD") + ("+" if git("status", "--porcelain", "--", *code) else "")


def machine() -> dict:
    return {"cpu": cpu_name(), "cpus": os.cpu_count(), "host": platform.node(), "python": sys.version.split()[0]}


def servers_for(model: str, gguf: Path, threads: str, ctx: int, logdir: Path, same_layout: bool = True) -> list:
    """The servers of one cell: ours and llama-server at `threads` (default: each its own choice); with
    same_layout, also llama-server --no-repack where ours keeps this GGUF's weights unrepacked (K-quants:
    edge/engines/llamacpp_load.py), the same weight layout and kernels as ours."""
    from edge.engines.llamacpp_load import auto_repacks
    bin_dir = tools_bin()
    n = None if threads == "default" else int(threads)
    out = [OursServer(gguf, n, ctx, logdir, label="ours"), LlamaServer(bin_dir, gguf, n, ctx, logdir)]
    if same_layout and not auto_repacks(str(gguf)):
        out.append(LlamaServer(bin_dir, gguf, n, ctx, logdir, extra=["--no-repack"]))
    if threads == "default":
        out.append(OursServer(gguf, 4, ctx, logdir, label="ours --threads 4 (llama.cpp's library default)"))
    return out


def run_cell(servers: list, cores: list, tokens: int, rounds: int, ids_for) -> dict:
    """Start the cell's servers on `cores`, one warm-up request each, then `rounds` interleaved rounds."""
    samples = {s.label: [] for s in servers}
    for s in servers:
        s.start(cores)
    try:
        for s in servers:
            s.request(ids_for(tokens // 4, -1 - servers.index(s)))      # warm-up: graphs, buffers, pages
        k = 0
        for r in range(rounds):
            order = servers if r % 2 == 0 else list(reversed(servers))
            for s in order:
                load = os.getloadavg()[0]
                got = s.request(ids_for(tokens, k))
                got["load1"] = load
                samples[s.label].append(got)
                k += 1
                print(f"  {s.label}: {got}", flush=True)
    finally:
        for s in servers:
            s.stop()
    return {"servers": {s.label: s.describe() for s in servers}, "samples": samples, "cores": cores}


def main(argv=None) -> None:
    args = parse_args(argv)
    from export.target_format import target_gguf
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    jpath = out.with_suffix(".json")
    data = json.loads(jpath.read_text()) if jpath.is_file() else {}
    data.setdefault("cells", {})
    command = "python -m benchmarks.engines.prefill_speed " + " ".join(sys.argv[1:] if argv is None else argv)
    data["machine"] = machine()
    data["commands"] = list(dict.fromkeys(data.get("commands", []) + [command]))   # the runs that filled it
    logdir = Path("runs/prefill_speed")

    def save() -> None:
        jpath.write_text(json.dumps(data, indent=1))

    for model in filter(None, args.models.split(",")):
        gguf = target_gguf(model)
        ids_for = prompt_ids(gguf)
        for threads in args.threads.split(","):
            key = f"{model}|{threads}"
            if key in data["cells"] and not args.redo:
                continue
            print(f"{model}, threads {threads}:", flush=True)
            t0 = time.time()
            cell = run_cell(servers_for(model, gguf, threads, args.ctx, logdir, args.same_layout), CORES[threads],
                            args.tokens, args.rounds, ids_for)
            data["cells"][key] = {"model": model, "gguf": gguf.name, "threads": threads, "tokens": args.tokens,
                                  "seconds": time.time() - t0, "commit": git_commit(), **cell}
            save()
    for model in filter(None, args.sweep.split(",")):
        if f"sweep|{model}" not in data["cells"] or args.redo:
            print(f"{model}: engine settings", flush=True)
            data["cells"][f"sweep|{model}"] = {"model": model, **sweep_engine(target_gguf(model), args.tokens,
                                                                              args.rounds)}
            save()
    if args.parallel and ("parallel" not in data["cells"] or args.redo):
        from benchmarks.lib.prefill_parallel import run_parallel
        data["cells"]["parallel"] = run_parallel(target_gguf("qwen2.5-coder-0.5b"), args.ctx, logdir)
        save()
    from benchmarks.lib.prefill_report import write_report
    write_report(data, out)
    print(f"wrote {out}.{{json,md,png}}")


if __name__ == "__main__":
    main()
