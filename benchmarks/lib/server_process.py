"""A benchmark's server process (benchmarks/lib/prefill_servers.py, benchmarks/serving/agent_workload/
servers.py, benchmarks/lib/reverse_star_parts.py): started pinned to its cores and dying with this
process, waited for until /health answers, stopped."""
from __future__ import annotations

import ctypes
import http.client
import os
import subprocess
import time
from pathlib import Path
from typing import Iterable, List

from benchmarks.lib.results import ROOT


def pinned(cores: Iterable[int]):
    """A child's preexec: on `cores`, and terminated when this process dies (a killed run leaves no
    server holding a core or a port; a rerun resumes)."""
    cores = set(cores)

    def pin():
        os.sched_setaffinity(0, cores)
        try:
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, 15)      # PR_SET_PDEATHSIG, SIGTERM
        except OSError:
            pass
    return pin


def spawn_pinned(argv: List[str], log: Path, cores: Iterable[int]) -> subprocess.Popen:
    """argv from the repository root, its stderr in `log`, on `cores`."""
    log.parent.mkdir(parents=True, exist_ok=True)
    return subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=open(log, "w"), cwd=ROOT,
                            env=dict(os.environ, PYTHONUNBUFFERED="1"), preexec_fn=pinned(cores))


def process_cpu_s(pid: int) -> float:
    """CPU seconds (user + system, every thread) the process has used so far: what a request cost it,
    read before and after, whatever else the machine runs (wall time counts the waits for a core)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def healthy(port: int) -> bool:
    """GET 127.0.0.1:port/health answers 200."""
    try:
        c = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
        c.request("GET", "/health")
        return c.getresponse().status == 200
    except (OSError, http.client.HTTPException):
        return False


def wait_healthy(proc: subprocess.Popen, port: int, timeout: float, name: str, log: Path,
                 gone: type = RuntimeError) -> None:
    """Until the server on `port` answers /health; `gone` (with its log's tail) if it exits first or
    never answers in `timeout` seconds."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise gone(f"{name} exited ({proc.returncode}); see {log}:\n" + log.read_text(errors="replace")[-1500:])
        if healthy(port):
            return
        time.sleep(0.5)
    raise gone(f"{name} never answered /health in {timeout:.0f}s; see {log}")


def stop_process(proc: subprocess.Popen) -> None:
    """SIGTERM, and SIGKILL if it has not left in 30 s."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
