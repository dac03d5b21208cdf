"""The two servers of benchmarks/sun/sun_vs_multilora.py, started as their users start them, and the
memory of their processes.

* llama-server: `llama-server -m BASE.gguf --lora t0.gguf --lora t1.gguf ... -np SLOTS -c SLOTS*CTX
  -t T -tb T -cram 0 --jinja`; each request names its adapter in the `lora` field, every adapter's
  scale explicit (benchmarks/lib/multilora_plan.lora_field). -cram 0: no host-memory prompt cache
  (SUN has none; llama-server's default would keep up to 8 GiB of old prompts' KV).
* SUN, colocated (the default): `edge-hub serve --mosquitto` (Mosquitto, the router, the OpenAI
  endpoint; --sun-request-timeout 1800: a burst on loaded cores takes longer than the default 300 s)
  and ONE `edge-agent run --role prefill --with-decoder --backend llamacpp --module BUNDLE --adapter
  t0=t0.gguf ... --max-batch SLOTS`: every adapter and the shared decoder over ONE load of the base
  (edge/cli/colocated_role.py). Split (colocated=False, the first record's): the hub also runs the
  shared decoder (--sun-decoder BUNDLE --sun-max-batch SLOTS), the prefill worker loads the base again.

Both sides' processes run under `taskset -c CORES`. Memory: every process of a side (its children
too: Mosquitto) sampled every 0.2 s (VmRSS, and PSS from smaps_rollup: pages shared between
processes counted once), each process's own peak (VmHWM), and the CPU seconds the side's processes
used during the burst (what other work on shared cores inflates least).
"""
from __future__ import annotations

import http.client
import json
import os
import secrets
import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence

from benchmarks.lib.results import ROOT
from benchmarks.lib.server_process import stop_process

BIN = ROOT / ".venv" / "bin"
REQUEST_TIMEOUT_S = 1800      # SUN's endpoint gives up on a request after this (llama-server never does)


class SideFailed(RuntimeError):
    """A server process died or never became ready (its log's tail is in the message)."""


def _pdeathsig():
    """A child's preexec: SIGTERM when the benchmark dies (a killed run leaves no server behind)."""
    try:
        import ctypes
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)
    except OSError:
        pass


def free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str, path: str, timeout: float = 60.0):
    host, port = url.split("//", 1)[1].rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=timeout)
    try:
        conn.request("GET", path)
        r = conn.getresponse()
        return r.status, r.read().decode("utf-8", "replace")
    finally:
        conn.close()


class Side:
    """One side's processes (started pinned to `cores`), its URL and its memory sampler."""

    name = "?"

    def __init__(self, cores: str, logdir: Path):
        self.cores, self.logdir = cores, logdir
        self.procs: Dict[str, subprocess.Popen] = {}
        self.argv: Dict[str, List[str]] = {}
        self.url = ""
        self.memory = MemorySampler(self.pids)

    def spawn(self, name: str, argv: Sequence) -> None:
        argv = ["taskset", "-c", self.cores, *[str(a) for a in argv]]
        self.logdir.mkdir(parents=True, exist_ok=True)
        self.argv[name] = argv
        self.procs[name] = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=open(self.logdir / f"{name}.err", "w"),
                                            env=dict(os.environ, PYTHONUNBUFFERED="1"), cwd=ROOT,
                                            preexec_fn=_pdeathsig)

    def pids(self) -> List[int]:
        """Every live process of the side: the started ones and their descendants (Mosquitto)."""
        out, todo = [], [p.pid for p in self.procs.values() if p.poll() is None]
        while todo:
            pid = todo.pop()
            out.append(pid)
            try:
                for tid in os.listdir(f"/proc/{pid}/task"):
                    todo.extend(int(c) for c in Path(f"/proc/{pid}/task/{tid}/children").read_text().split())
            except OSError:
                pass
        return out

    def check_alive(self) -> None:
        for name, p in self.procs.items():
            if p.poll() is not None:
                tail = (self.logdir / f"{name}.err").read_text(errors="replace")[-2000:]
                raise SideFailed(f"{self.name}: {name} exited ({p.returncode}):\n{tail}")

    def wait_until(self, ready, what: str, timeout: float) -> None:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            self.check_alive()
            try:
                if ready():
                    return
            except (OSError, http.client.HTTPException, ValueError):
                pass
            time.sleep(0.5)
        raise SideFailed(f"{self.name}: not {what} after {timeout:.0f} s (logs in {self.logdir})")

    def stop(self) -> None:
        for p in reversed(list(self.procs.values())):
            stop_process(p)

    def describe(self) -> dict:
        return {"cores": self.cores, "commands": {k: " ".join(v) for k, v in self.argv.items()}}


class LlamaServerSide(Side):
    name = "llama-server"

    def __init__(self, server_bin: Path, base: Path, adapters: Sequence[Path], slots: int, ctx: int,
                 threads: int, cores: str, logdir: Path):
        super().__init__(cores, logdir)
        self.bin, self.base, self.adapters = server_bin, base, list(adapters)
        self.slots, self.ctx, self.threads = slots, ctx, threads

    def start(self, timeout: float = 600) -> "LlamaServerSide":
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        loras = [x for a in self.adapters for x in ("--lora", a)]
        self.spawn("llama-server", [self.bin, "-m", self.base, *loras, "-np", self.slots, "-c", self.slots * self.ctx,
                                    "-t", self.threads, "-tb", self.threads, "-cram", 0, "--jinja",
                                    "--host", "127.0.0.1", "--port", port])
        self.wait_until(lambda: _get(self.url, "/health")[0] == 200, "healthy", timeout)
        _, body = _get(self.url, "/lora-adapters")
        if len(json.loads(body)) != len(self.adapters):
            raise SideFailed(f"llama-server lists {len(json.loads(body))} adapters, {len(self.adapters)} were given")
        return self

    def body(self, task: Optional[int], n_tasks: int) -> dict:
        from benchmarks.lib.multilora_plan import lora_field
        return {"model": "base", "lora": lora_field(task, len(self.adapters))}


class SunSide(Side):
    name = "sun"

    def __init__(self, bundle: Path, adapters: Dict[str, Path], tokenizer: str, slots: int,
                 prefill_threads: int, decoder_threads: int, cores: str, logdir: Path, colocated: bool = True):
        super().__init__(cores, logdir)
        self.bundle, self.adapters, self.tokenizer, self.slots = bundle, dict(adapters), tokenizer, slots
        self.prefill_threads, self.decoder_threads = prefill_threads, decoder_threads
        self.colocated = colocated

    def start(self, timeout: float = 900) -> "SunSide":
        mqtt, http_port = free_port(), free_port()
        key = self.logdir / "ctl.key"
        self.logdir.mkdir(parents=True, exist_ok=True)
        key.write_text(secrets.token_hex(24))
        self.url = f"http://127.0.0.1:{http_port}"
        decoder = [] if self.colocated else ["--sun-decoder", self.bundle, "--sun-backend", "llamacpp",
                                             "--sun-max-batch", self.slots, "--threads", self.decoder_threads]
        self.spawn("hub", [BIN / "edge-hub", "-v", "serve", "--mosquitto", "--port", mqtt, "--ctl-key-file", key,
                           *decoder, "--sun-http-port", http_port, *self.lazy("--sun-grammars-on-demand"),
                           "--sun-tokenizer", self.tokenizer, "--sun-request-timeout", REQUEST_TIMEOUT_S])
        self.wait_until(lambda: "serving on" in (self.logdir / "hub.err").read_text(), "serving", timeout)
        ads = [x for t, p in self.adapters.items() for x in ("--adapter", f"{t}={p}")]
        # colocated: one process, one base; --threads is each context's (prefill, decoder)
        both = ["--with-decoder", "--max-batch", self.slots, *self.lazy("--grammars-on-demand")] if self.colocated else []
        self.spawn("prefill", [BIN / "edge-agent", "run", "--role", "prefill", "--backend", "llamacpp",
                               "--module", self.bundle, *ads, *both, "--broker", f"mqtt://127.0.0.1:{mqtt}",
                               "--client-id", "prefill-lora", "--threads", self.prefill_threads,
                               "--ctl-key-file", key])
        want = set(self.adapters)
        self.wait_until(lambda: want <= {m["id"] for m in json.loads(_get(self.url, "/v1/models")[1])["data"]},
                        f"serving all {len(want)} tasks", timeout)
        return self

    def lazy(self, flag: str) -> list:
        """Colocated: grammar tokenizers load at the first grammar (none in this burst), as llama-server
        builds a grammar only for a request that has one; split: as the first record ran (at start)."""
        return [flag] if self.colocated else []

    def body(self, task: Optional[int], n_tasks: int) -> dict:
        from benchmarks.lib.multilora_plan import task_name
        return {"model": task_name(task)}

    def describe(self) -> dict:
        """Also the prefills run for the cell's requests, from the logs (after stop: the worker's stats)."""
        from benchmarks.lib.sun_prefill_counts import prefill_counts
        return {**super().describe(), "prefills": prefill_counts(self.logdir)}


def _status_kb(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


def _cpu_s(pid: int) -> float:
    """utime + stime of the process so far (its threads included)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _pss_kb(pid: int) -> int:
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
        if line.startswith("Pss:"):
            return int(line.split()[1])
    return 0


class MemorySampler:
    """Peak of the side's summed RSS and PSS, sampled every `every` s while running; VmHWM per
    process (each one's own peak) read at every sample and kept."""

    def __init__(self, pids, every: float = 0.2):
        self._pids, self.every = pids, every
        self.peak_rss = self.peak_pss = 0
        self.hwm: Dict[int, int] = {}
        self.names: Dict[int, str] = {}
        self.cpu_first: Dict[int, float] = {}
        self.cpu_last: Dict[int, float] = {}
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def sample(self) -> None:
        rss = pss = 0
        for pid in self._pids():
            try:
                rss += _status_kb(pid, "VmRSS")
                pss += _pss_kb(pid)
                self.hwm[pid] = max(self.hwm.get(pid, 0), _status_kb(pid, "VmHWM"))
                self.cpu_last[pid] = _cpu_s(pid)
                self.cpu_first.setdefault(pid, self.cpu_last[pid])
                self.names.setdefault(pid, Path(f"/proc/{pid}/comm").read_text().strip())
            except (OSError, ValueError):
                continue
        self.peak_rss, self.peak_pss = max(self.peak_rss, rss * 1024), max(self.peak_pss, pss * 1024)

    def start(self) -> "MemorySampler":
        def loop():
            while not self._stop.wait(self.every):
                self.sample()
        self.sample()
        self._thread = threading.Thread(target=loop, daemon=True)
        self._thread.start()
        return self

    def stop(self) -> dict:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.sample()
        return {"peak_rss_sum": self.peak_rss, "peak_pss_sum": self.peak_pss,
                "hwm_sum": sum(self.hwm.values()) * 1024,
                "cpu_s": sum(self.cpu_last[p] - self.cpu_first[p] for p in self.cpu_last),
                "per_process_hwm": {f"{self.names.get(p, '?')}[{p}]": kb * 1024 for p, kb in self.hwm.items()}}
