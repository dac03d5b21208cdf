"""The two servers benchmarks/engines/prefill_speed.py compares, pinned to the same cores, and its prompts.

Each request is timed by its wall time and by the CPU seconds the server process spent on it
(/proc/PID/stat: all its threads), the second being what a shared machine's other work
disturbs least.
"""
from __future__ import annotations

import http.client
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, List, Optional, Sequence

from benchmarks.lib.datasets import mtbench_questions
from benchmarks.lib.results import ROOT
from benchmarks.lib.server_process import pinned, spawn_pinned, stop_process, wait_healthy

TICK = os.sysconf("SC_CLK_TCK")
FIRST_WORDS = ["Alpha", "Bravo", "Charlie", "Delta", "Echo", "Foxtrot", "Golf", "Hotel", "India", "Juliet",
               "Kilo", "Lima", "Mike", "November", "Oscar", "Papa", "Quebec", "Romeo", "Sierra", "Tango",
               "Uniform", "Victor", "Whiskey", "Xray", "Yankee", "Zulu"]


def tools_bin() -> Path:
    """llama.cpp's tools built by `make llama-tools` (scripts/llama_tools.sh; built here on first use)."""
    p = subprocess.run(["bash", str(ROOT / "scripts" / "llama_tools.sh"), str(Path(sys.executable).parent)],
                       capture_output=True, text=True)
    if p.returncode != 0:
        sys.exit(f"building llama.cpp's tools failed:\n{p.stderr[-2000:]}")
    return Path(p.stdout.strip().splitlines()[-1])


def prompt_ids(gguf: Path) -> Callable[[int, int], List[int]]:
    """ids(n, k): n token ids of MT-bench text whose first token is request k's own (no shared prefix)."""
    from edge.model.tokenizer import Tokenizer
    tok = Tokenizer.from_gguf(gguf)
    rows = mtbench_questions()              # fetched on first use
    body = tok.encode("\n\n".join(t for r in rows for t in r["turns"]))
    firsts = list(dict.fromkeys(tok.encode(w)[0] for w in FIRST_WORDS))

    def ids(n: int, k: int) -> List[int]:
        need = n - 1
        text = (body * (need // len(body) + 1))[:need]
        return [firsts[k % len(firsts)]] + text
    return ids


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """One server process: started pinned, asked over HTTP, its CPU seconds read from /proc."""
    label = "?"

    def __init__(self, gguf: Path, threads: Optional[int], ctx: int, logdir: Path):
        self.gguf, self.threads, self.ctx, self.logdir = gguf, threads, ctx, logdir
        self.proc: Optional[subprocess.Popen] = None
        self.argv: List[str] = []
        self.port = 0

    def command(self) -> List[str]:
        raise NotImplementedError

    def start(self, cores: List[int]) -> None:
        self.port = _free_port()
        self.argv = [str(a) for a in self.command()]
        log = self.logdir / f"{self.label.split()[0]}-{self.port}.err"
        self.proc = spawn_pinned(self.argv, log, cores)
        self.cores = cores
        wait_healthy(self.proc, self.port, 900, self.label, log)

    def stop(self) -> None:
        if self.proc is not None:
            stop_process(self.proc)

    def cpu_seconds(self) -> float:
        f = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(f[11]) + int(f[12])) / TICK

    def _post(self, path: str, body: dict) -> dict:
        c = http.client.HTTPConnection("127.0.0.1", self.port, timeout=3600)
        c.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
        r = c.getresponse()
        data = r.read()
        if r.status != 200:
            raise RuntimeError(f"{self.label} answered {r.status}: {data[:300]!r}")
        return json.loads(data)

    def request(self, ids: List[int]) -> dict:
        """One prompt, one completion token: wall and CPU seconds, prompt tokens a second of each."""
        c0, t0 = self.cpu_seconds(), time.perf_counter()
        extra = self._ask(ids)
        wall, cpu = time.perf_counter() - t0, self.cpu_seconds() - c0
        return {"prompt_tokens": len(ids), "wall_s": round(wall, 3), "cpu_s": round(cpu, 2),
                "tok_s": round(len(ids) / wall, 2), "cpu_tok_s": round(len(ids) / max(cpu, 1e-9), 2), **extra}

    def _ask(self, ids: List[int]) -> dict:
        raise NotImplementedError

    def describe(self) -> dict:
        return {"command": " ".join(self.argv), "cores": self.cores}


class OursServer(Server):
    """The endpoint `edge-agent run --role target` serves, target-only (benchmarks/lib/agent_alone_worker.py)."""

    def __init__(self, gguf, threads, ctx, logdir, label: str = "ours", parallel: Optional[int] = None):
        super().__init__(gguf, threads, ctx, logdir)
        self.label, self.parallel = label, parallel

    def command(self) -> List[str]:
        return [sys.executable, "-m", "benchmarks.lib.agent_alone_worker", "--model", self.gguf, "--port", self.port,
                "--max-len", self.ctx, *(["--threads", self.threads] if self.threads else []),
                *(["--parallel", self.parallel] if self.parallel else [])]

    def _ask(self, ids: List[int]) -> dict:
        d = self._post("/v1/completions", {"prompt": ids, "max_tokens": 1, "temperature": 0})
        details = d.get("usage", {}).get("prompt_tokens_details") or {}
        t = d.get("timings") or {}              # llama-server's names (edge/api/timings.py)
        return {"cached_tokens": details.get("cached_tokens", 0), "server_prompt_n": t.get("prompt_n"),
                "server_prompt_per_second": round(t.get("prompt_per_second", 0.0), 2)}


class LlamaServer(Server):
    label = "llama-server"

    def __init__(self, bin_dir: Path, gguf, threads, ctx, logdir, np_: int = 1, extra: Sequence[str] = ()):
        """extra: more llama-server options (e.g. --no-repack), named in the label."""
        super().__init__(gguf, threads, ctx, logdir)
        self.bin, self.np, self.extra = bin_dir / "llama-server", np_, list(extra)
        self.label = " ".join(["llama-server", *([f"-np {np_}"] if np_ > 1 else []), *self.extra])

    def command(self) -> List[str]:
        t = ["-t", self.threads, "-tb", self.threads] if self.threads else []
        return [self.bin, "-m", self.gguf, *t, "-np", self.np, "-c", self.ctx * self.np, *self.extra,
                "--host", "127.0.0.1", "--port", self.port]

    def _ask(self, ids: List[int]) -> dict:
        d = self._post("/completion", {"prompt": ids, "n_predict": 1, "cache_prompt": False, "temperature": 0})
        t = d.get("timings", {})
        return {"server_prompt_per_second": round(t.get("prompt_per_second", 0.0), 2),
                "cached_tokens": t.get("cache_n", 0), "server_prompt_n": t.get("prompt_n")}

    def describe(self) -> dict:
        v = subprocess.run([str(self.bin), "--version"], capture_output=True, text=True)
        return {**super().describe(), "version": (v.stdout + v.stderr).strip().splitlines()[-2:]}


def sweep_engine(gguf: Path, tokens: int, rounds: int) -> dict:
    """The engine alone, one thread on core 0, at each setting (benchmarks/lib/prefill_engine_worker.py)."""
    p = subprocess.run([sys.executable, "-m", "benchmarks.lib.prefill_engine_worker", str(gguf), str(tokens),
                        str(rounds)], capture_output=True, text=True, cwd=ROOT, preexec_fn=pinned([0]))
    if p.returncode != 0:
        raise RuntimeError(f"the engine sweep failed:\n{p.stderr[-2000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])
