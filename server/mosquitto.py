"""A Mosquitto process for the hub and the tests, configured in a temp dir, dying with its parent."""
from __future__ import annotations

import ctypes
import os
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from typing import Optional

from server.acl import Acl
from server.broker_base import BrokerError, _BrokerBase, _check_port_free, _wait_port, find_free_port


class MosquittoBroker(_BrokerBase):
    """A mosquitto process on a loopback port (the hub's own connection), configured in a temp
    dir, plus any `listeners` (other addresses, TLS). It dies with its parent: PR_SET_PDEATHSIG
    when started from the main thread, and a pid file per port that the next start reads to
    stop an orphan of an earlier, killed hub (else it would keep the port)."""

    def __init__(self, port: Optional[int] = None, host: str = "127.0.0.1", acl: bool = False,
                 hub_user: str = "hub", workdir: Optional[str] = None, listeners=()) -> None:
        self.exe = shutil.which("mosquitto") or next(
            (p for p in ("/usr/sbin/mosquitto", "/usr/local/sbin/mosquitto") if os.access(p, os.X_OK)), None)
        if not self.exe:
            raise BrokerError("mosquitto is not installed: `apt-get install mosquitto` "
                              "(or `brew install mosquitto`), or use the embedded broker")
        self.host, self.port = host, port or find_free_port(host)
        self.listeners = list(listeners)
        self.acl = Acl() if acl else None
        self.hub_user = hub_user
        self.hub_password = self.acl.add(hub_user, "hub") if self.acl else ""
        self._own_dir = workdir is None
        self.dir = Path(workdir or tempfile.mkdtemp(prefix="ss-mosquitto-"))
        self.proc: Optional[subprocess.Popen] = None

    def _write_files(self) -> None:
        conf = [f"listener {self.port} {self.host}", "set_tcp_nodelay true", "max_queued_messages 0",
                "persistence false", f"log_dest file {self.dir / 'mosquitto.log'}",
                "log_type error", "log_type warning", "log_type notice", "log_type information"]
        for ln in self.listeners:
            conf.append(f"listener {ln.port} {ln.host}")
            if ln.tls is not None:     # devices prove who they are with the star's certificates
                conf += [f"cafile {ln.tls.ca}", f"certfile {ln.tls.cert}", f"keyfile {ln.tls.key}",
                         "require_certificate true", "use_identity_as_username true", "tls_version tlsv1.2"]
        if os.geteuid() == 0:
            conf.append("user root")               # else it drops to 'mosquitto' and cannot read dir
        if self.acl:
            conf += ["allow_anonymous false", f"password_file {self.dir / 'passwd'}",
                     f"acl_file {self.dir / 'acl'}"]
            path = self.dir / "passwd"
            path.write_text("")
            path.chmod(0o600)
            for name in self.acl.users:
                self._write_password(name)
            (self.dir / "acl").write_text(self.acl.mosquitto_acl())
        else:
            conf.append("allow_anonymous true")
        (self.dir / "mosquitto.conf").write_text("\n".join(conf) + "\n")

    def _write_password(self, name: str) -> None:
        tool = shutil.which("mosquitto_passwd") or "/usr/bin/mosquitto_passwd"
        r = subprocess.run([tool, "-b", str(self.dir / "passwd"), name, self.acl.users[name][1]],
                           capture_output=True, text=True)
        if r.returncode:
            raise BrokerError(f"mosquitto_passwd failed for {name!r}: {r.stderr.strip() or r.stdout.strip()}")

    def _reload(self, name: str) -> None:
        if self.proc and self.proc.poll() is None:
            self._write_password(name)
            (self.dir / "acl").write_text(self.acl.mosquitto_acl())
            before = self._log_count("Reloading config.")
            self.proc.send_signal(signal.SIGHUP)   # mosquitto re-reads password and ACL files
            end = time.monotonic() + 5              # single-threaded: once logged, it is done
            while self._log_count("Reloading config.") == before and time.monotonic() < end:
                time.sleep(0.005)

    def _log_count(self, text: str) -> int:
        p = self.dir / "mosquitto.log"
        return p.read_text(errors="replace").count(text) if p.exists() else 0

    def log_tail(self, n: int = 20) -> str:
        p = self.dir / "mosquitto.log"
        return "\n".join(p.read_text(errors="replace").splitlines()[-n:]) if p.exists() else ""

    def start(self, timeout: float = 10.0) -> "MosquittoBroker":
        if self.proc and self.proc.poll() is None:
            return self
        for host, port in [(self.host, self.port)] + [(ln.host, ln.port) for ln in self.listeners]:
            _stop_orphan(port)
            _check_port_free(host, port)
        self._write_files()
        main = threading.current_thread() is threading.main_thread()
        self.proc = subprocess.Popen([self.exe, "-c", str(self.dir / "mosquitto.conf")],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                     preexec_fn=_die_with_parent if main else None)
        ok = all(_wait_port(h if h not in ("0.0.0.0", "::") else "127.0.0.1", p, timeout,
                            alive=lambda: self.proc.poll() is None)
                 for h, p in [(self.host, self.port)] + [(ln.host, ln.port) for ln in self.listeners])
        if not ok:
            err = self.proc.stderr.read().decode(errors="replace") if self.proc.poll() is not None else ""
            self.stop()
            raise BrokerError(f"mosquitto did not start on {self.host}:{self.port}: "
                              f"{(err + self.log_tail()).strip() or 'timed out'}")
        for port in [self.port] + [ln.port for ln in self.listeners]:
            _pid_file(port).write_text(f"{self.proc.pid} {os.getpid()}\n")
        return self

    def stop(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        if self.proc.stderr:
            self.proc.stderr.close()
        for port in [self.port] + [ln.port for ln in self.listeners]:
            _pid_file(port).unlink(missing_ok=True)
        self.proc = None

    def close(self) -> None:
        """Stop and remove the temp dir."""
        self.stop()
        if self._own_dir:
            shutil.rmtree(self.dir, ignore_errors=True)

    def __exit__(self, *exc) -> None:
        self.close()


_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    """In the child before exec: the kernel sends SIGTERM when the parent (thread) dies."""
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)


def _pid_file(port: int) -> Path:
    d = Path(tempfile.gettempdir()) / "starsun-brokers"
    d.mkdir(exist_ok=True)
    return d / f"mosquitto-{port}.pid"


def _stop_orphan(port: int) -> None:
    """Stop a Mosquitto that an earlier broker of ours left on this port when its owner died
    (a live owner's broker is left alone: then the port is simply taken)."""
    path = _pid_file(port)
    try:
        pid, owner = (int(x) for x in path.read_text().split())
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except (OSError, ValueError):
        path.unlink(missing_ok=True)
        return
    if _alive(owner):
        return
    if cmd and cmd[0].endswith(b"mosquitto") and any(b"ss-mosquitto-" in c for c in cmd):
        os.kill(pid, signal.SIGTERM)
        for _ in range(100):
            if not _alive(pid):
                break
            time.sleep(0.05)
    path.unlink(missing_ok=True)


def _alive(pid: int) -> bool:
    return b"zombie" not in _proc_state(pid)


def _proc_state(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/status").read_bytes()
    except OSError:
        return b"zombie"
