"""Agent workloads on a device's OpenAI endpoint: ours (alone, and through the star) vs llama.cpp's llama-server, one run.

Same GGUF, one thread, core 0 for every server (issue #44 item 7):

* llama-server, built from the llama.cpp vendored in the kit's llama-cpp-python (`make llama-tools`),
  `--jinja -t 1 -tb 1 -np 4` (its defaults otherwise: context from the model, prompt cache on);
* ours alone: our OpenAIServer over target-only llama.cpp decoding with the prompt cache and
  `--parallel` generations at once (benchmarks/lib/agent_alone_worker.py; a target started with
  no hub waits its 3 s join timeout on every request, so the star-less endpoint is built there);
* ours through the star: `edge-agent run --role target -g auto --threads 1 --parallel N` on
  core 0, the hub (`edge-hub serve`) and a draft service (the 0.5B, Q4_0, one thread) on core 1,
  Mosquitto.

Three questions, each a cell per (server, model):

* **BFCL tool calling** (simple, multiple, parallel; `--cases` each, evenly spaced over the
  category): BFCL's functions sent as OpenAI `tools` (tool_choice auto, parallel_tool_calls true
  -- OpenAI's default; llama-server's is false --, temperature 0), the returned tool_calls
  checked by BFCL's own AST checker against possible_answer (benchmarks/lib/bfcl_check.py). A
  reply whose calls the server did not parse scores 0: it is what its users get.
* **A multi-turn session**: an ~1,800-token system prompt (rules and a code module), then
  `--turns` user turns, each appending the previous answer; streamed: TTFT per turn (the first
  content or tool delta) and the session's total time; medians over `--sessions` sessions (each
  opens with its own line, so its first turn is cold).
* **Concurrent clients**: `--clients` threads each sending `--requests` MT-bench first turns
  back to back (streamed): total completion tok/s over the window, p50 / p99 latency.

Resumable: every cell checkpoints into the result JSON as it finishes (BFCL case by case, the
session by session); a rerun with the same --out skips what is there (`--redo PATTERN` drops
the cells whose server|model|part key matches first, so they run again). The servers run one
at a time (model by model, server by server), this process on core 1.

  python -m benchmarks.serving.agent_workload [--models M,M] [--servers llama-server,ours,ours-star]
      [--cases 100] [--turns 5] [--sessions 3] [--clients 4] [--requests 4] [--parallel 4]
      [--redo 'ours|*|concurrent'] [--quick]
  nohup .venv/bin/python -m benchmarks.serving.agent_workload > runs/agent_workload.log 2>&1 &

Run from the repository root (`make llama-tools` first, or the first run builds it: minutes).
Writes benchmarks/results/agent_workload/<variant>.{json,md,png} (--out; default: `default`;
--quick: `smoke`). The package: options.py (the CLI), store.py (the resumable JSON), client.py
(one request), servers.py (the three servers), bfcl.py / multiturn.py / concurrent.py (the
parts), runner.py (the run), report.py (markdown and figure).
"""
from benchmarks.serving.agent_workload.options import CATEGORIES, MODELS, PARTS, SERVERS, args_of, part_keys
from benchmarks.serving.agent_workload.report import write_report
from benchmarks.serving.agent_workload.runner import main, run
from benchmarks.serving.agent_workload.store import Store

__all__ = ["CATEGORIES", "MODELS", "PARTS", "SERVERS", "Store", "args_of", "main", "part_keys", "run",
           "write_report"]
