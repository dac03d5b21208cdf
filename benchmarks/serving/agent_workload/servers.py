"""The servers, one at a time on TARGET_CORE (--server-core may swap the cores): llama-server, ours alone (benchmarks/lib/agent_alone_worker.py)
and ours through the star (`edge-agent run --role target`, the hub and draft service on STAR_CORE)."""
from __future__ import annotations

import contextlib
import socket
import subprocess
import sys
from pathlib import Path
from typing import List, Optional

from benchmarks.lib.chat_client import ServerGone
from benchmarks.lib.server_process import spawn_pinned, stop_process, wait_healthy

BIN = Path(sys.executable).parent
TARGET_CORE, STAR_CORE = 0, 1


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

    def __init__(self, model: str, gguf: Path, port: int, logdir: Path, core: int = TARGET_CORE):
        self.model, self.gguf, self.port, self.logdir, self.core = model, gguf, port, logdir, core
        self.url = f"http://127.0.0.1:{port}"
        self.proc: Optional[subprocess.Popen] = None
        self.log = logdir / f"{self.name}.err"
        self.argv: List[str] = []

    def _spawn(self, argv: List[str]) -> None:
        self.argv = [str(a) for a in argv]
        self.proc = spawn_pinned(self.argv, self.log, [self.core])

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def wait_ready(self, timeout: float = 600.0) -> None:
        wait_healthy(self.proc, self.port, timeout, self.name, self.log, gone=ServerGone)

    def start(self) -> "Server":
        raise NotImplementedError

    def stop(self) -> None:
        if self.proc is not None:
            stop_process(self.proc)

    def describe(self) -> dict:
        return {"command": " ".join(self.argv), "core": self.core}


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

    def __init__(self, *a, parallel: int, repack: str = "auto", ram: Optional[float] = None):
        super().__init__(*a)
        self.parallel, self.repack, self.ram = parallel, repack, ram

    def start(self) -> "OursAlone":
        self._spawn([sys.executable, "-m", "benchmarks.lib.agent_alone_worker", "--model", self.gguf,
                     "--port", self.port, "--threads", 1, "--parallel", self.parallel, *repack_args(self.repack),
                     *ram_args(self.ram)])
        self.wait_ready()
        return self


class OursStar(Server):
    """The two-device star: Mosquitto, then the hub and a draft service on STAR_CORE
    (server/demos/two_device.py's RemoteStar), then `edge-agent run --role target` on TARGET_CORE."""
    name = "ours-star"

    def __init__(self, *a, draft: Path, gamma: str, parallel: int, repack: str = "auto", ram: Optional[float] = None):
        super().__init__(*a)
        self.draft, self.gamma, self.parallel, self.repack, self.ram = draft, gamma, parallel, repack, ram
        self.stack = contextlib.ExitStack()

    def start(self) -> "OursStar":
        from server.demos.two_device import RemoteStar
        from server.mosquitto import MosquittoBroker
        try:
            broker = MosquittoBroker().start()
            self.stack.callback(broker.close)
            self.broker_url = broker.url
            self.stack.enter_context(RemoteStar(str(self.draft), self.logdir / "star", core=1 - self.core,
                                                broker_url=broker.url))
            self._spawn([BIN / "edge-agent", "run", "--role", "target", "-m", self.gguf, "--broker", broker.url,
                         "--http-port", self.port, "--client-id", "dev0", "-g", self.gamma, "--threads", 1,
                         "--parallel", self.parallel, *repack_args(self.repack), *ram_args(self.ram)])
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
                                              f"{1 - self.core}, Mosquitto", "joined": self.joined()}


def make_server(name: str, model: str, port: int, args, ctx: dict) -> Server:
    from export.target_format import target_gguf
    gguf = target_gguf(model)
    logdir, core = ctx["logdir"] / f"{name}-{Path(str(model)).name}", args.server_core
    if name == "llama-server":
        return LlamaServer(model, gguf, port, logdir, core, bin_dir=ctx["bin_dir"](), np_=args.np)
    repack, ram = getattr(args, "repack", "auto"), getattr(args, "prompt_cache_ram", None)
    if name == "ours":
        return OursAlone(model, gguf, port, logdir, core, parallel=args.parallel, repack=repack, ram=ram)
    return OursStar(model, gguf, port, logdir, core, draft=target_gguf(args.draft, args.draft_format), gamma=args.gamma,
                    parallel=args.parallel, repack=repack, ram=ram)


def ram_args(mb: Optional[float]) -> list:
    """--prompt-cache-ram for ours' command line; none for the default."""
    return [] if mb is None else ["--prompt-cache-ram", mb]


def repack_args(mode: str) -> list:
    """--repack for ours' command line; none for auto (the command, as recorded, stays the default's)."""
    return [] if mode == "auto" else ["--repack", mode]
