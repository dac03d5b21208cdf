"""The device's shell over ssh: run a script, read file hashes, write a file, push files.

Every ssh runs with BatchMode (no password prompt: provisioning needs a key, `ssh-copy-id`)
and a connect timeout, so an unreachable device fails in seconds with ssh's own reason.
Files are copied with rsync when both ends have it (resumable, only what changed), else
with scp (SFTP since OpenSSH 9). Secrets travel as files, never as arguments.
"""
from __future__ import annotations

import hashlib
import shlex
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Dict, Iterable, List, Optional, Sequence


class RemoteError(RuntimeError):
    """A command on the device failed; the message carries its output."""


_HASHES: Dict[tuple, str] = {}          # (path, size, mtime) -> sha256: a run hashes each file once


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    st = Path(path).stat()
    key = (str(path), st.st_size, st.st_mtime_ns)
    if key not in _HASHES:
        h = hashlib.sha256()
        with open(path, "rb") as f:
            for b in iter(lambda: f.read(chunk), b""):
                h.update(b)
        _HASHES[key] = h.hexdigest()
    return _HASHES[key]


def local_files(src: Path) -> List[Path]:
    """The files of a file or a directory (sorted, symlinks followed as rsync -L and scp do)."""
    src = Path(src)
    if src.is_file():
        return [src]
    return sorted(p for p in src.rglob("*") if p.is_file())


class Remote:
    def __init__(self, dest: str, ssh_config: Optional[str] = None, connect_timeout: int = 10):
        self.dest = dest
        self.ssh_config = ssh_config
        self.connect_timeout = connect_timeout
        self.rsync = False                  # set once the device says it has rsync
        self._mux: Optional[str] = None     # one ssh connection for the run's many commands

    # ---- argv builders (also what DRY=1 prints) ----
    def _ssh_opts(self) -> List[str]:
        opts = ["-o", "BatchMode=yes", "-o", f"ConnectTimeout={self.connect_timeout}"]
        if self._mux:
            opts += ["-o", "ControlMaster=auto", "-o", f"ControlPath={self._mux}/%C", "-o", "ControlPersist=60"]
        return (["-F", self.ssh_config] if self.ssh_config else []) + opts

    def multiplex(self) -> "Remote":
        """Share one connection between the run's ssh, rsync and scp calls (close() ends it)."""
        self._mux = tempfile.mkdtemp(prefix="ss-mux-")
        return self

    def close(self) -> None:
        if self._mux:
            subprocess.run(["ssh", *self._ssh_opts(), "-O", "exit", self.dest], capture_output=True)
            shutil.rmtree(self._mux, ignore_errors=True)
            self._mux = None

    def ssh_argv(self, script: str) -> List[str]:
        return ["ssh", *self._ssh_opts(), self.dest, script]

    def push_argv(self, src: Path, remote_dir: str) -> List[str]:
        """Copy a file or a directory into remote_dir (a directory lands as remote_dir/NAME)."""
        if self.rsync:
            return ["rsync", "-rtL", "--partial", "-e", shlex.join(["ssh", *self._ssh_opts()]),
                    str(src), f"{self.dest}:{remote_dir}/"]
        return ["scp", "-q", "-r", *self._ssh_opts(), str(src), f"{self.dest}:{remote_dir}/"]

    # ---- doing it ----
    def sh(self, script: str, input: Optional[bytes] = None, check: bool = True) -> str:
        """Run a POSIX sh script on the device; its stdout (RemoteError with stderr on failure)."""
        r = subprocess.run(self.ssh_argv(script), input=input, capture_output=True)
        if check and r.returncode != 0:
            err = (r.stderr or r.stdout).decode(errors="replace").strip()
            raise RemoteError(err or f"exit status {r.returncode}")
        return r.stdout.decode(errors="replace")

    def sha256(self, paths: Iterable[str]) -> Dict[str, str]:
        """{path: sha256} of those that exist on the device (missing ones are left out)."""
        paths = list(paths)
        if not paths:
            return {}
        out = self.sh("sha256sum -- " + " ".join(shlex.quote(p) for p in paths) + " 2>/dev/null; true")
        hashes = {}
        for line in out.splitlines():
            digest, _, name = line.partition("  ")
            if name:
                hashes[name] = digest
        return hashes

    def write(self, path: str, data: bytes, mode: str = "644", sudo: bool = False) -> None:
        """Write a file atomically (a temp file, then rename): a cut connection leaves the old one."""
        q, tmp = shlex.quote(path), shlex.quote(path + ".tmp")
        pre = "sudo -n " if sudo else ""
        self.sh(f"set -e; umask 077; {pre}mkdir -p {shlex.quote(str(Path(path).parent))}; "
                f"{pre}tee {tmp} >/dev/null; {pre}chmod {mode} {tmp}; {pre}mv -f {tmp} {q}", input=data)

    def push(self, src: Path, remote_dir: str) -> None:
        self.sh(f"mkdir -p {shlex.quote(remote_dir)}")
        r = subprocess.run(self.push_argv(src, remote_dir), capture_output=True)
        if r.returncode != 0:
            raise RemoteError((r.stderr or r.stdout).decode(errors="replace").strip()
                              or f"{'rsync' if self.rsync else 'scp'} exit status {r.returncode}")


def changed_files(remote: Remote, pairs: Sequence[tuple]) -> List[tuple]:
    """The (local, remote path) pairs whose hash on the device differs from the local file's."""
    there = remote.sha256(r for _, r in pairs)
    return [(loc, rem) for loc, rem in pairs if there.get(rem) != sha256_file(loc)]
