"""A "device" for provisioning tests: a real sshd on a loopback port, its own host key, a
dedicated user made with useradd (the tests run as root), and an ssh config that reaches it.

The device's Python already has the kit's dependencies, as a JetPack image has its CUDA torch
in the system site packages: a .pth in the user's site directory points at a directory of
links to this checkout's .venv packages (less the kit itself, which provisioning installs).
So provisioning runs with --deps device (the kit's wheel --no-deps into a venv over the
system site packages) instead of downloading torch in a test.
"""
from __future__ import annotations

import os
import pwd
import shutil
import socket
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

from harness.waiting import wait_until

SSHD = "/usr/sbin/sshd"
NOT_DEPS = ("starsun", "__editable__", "_virtualenv")     # the kit comes from the provisioned wheel


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(*argv, **kw):
    return subprocess.run(list(argv), check=True, capture_output=True, text=True, **kw)


class SshDevice:
    def __init__(self, name: str = "flashdev"):
        if not os.path.exists(SSHD):
            raise RuntimeError("sshd is not installed: bash scripts/ensure_system.sh sshd "
                               "(apt-get install openssh-server rsync)")
        if os.geteuid() != 0:
            raise RuntimeError("the provisioning tests make a user and run sshd: run them as root (CI does)")
        self.alias = name
        self.user = f"ssdev{os.getpid() % 100000}"
        self.base = Path(tempfile.mkdtemp(prefix="starsun-device-"))
        self.base.chmod(0o755)
        self.home = self.base / "home"
        self.pc = self.base / "pc"                 # the PC's side: keys, known_hosts, ssh config (root only)
        self.pc.mkdir(mode=0o700)
        self.port = free_port()
        self.proc = None

    def start(self) -> "SshDevice":
        _run("useradd", "-m", "-d", str(self.home), "-s", "/bin/bash", self.user)
        _run("usermod", "-p", "*", self.user)     # no password, but not locked: sshd accepts its key
        pw = pwd.getpwnam(self.user)
        _run("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(self.pc / "id"))
        _run("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(self.pc / "host_key"))
        ssh = self.home / ".ssh"
        ssh.mkdir(mode=0o700)
        shutil.copy(self.pc / "id.pub", ssh / "authorized_keys")
        self._device_python_has_deps()
        for p in [ssh, *ssh.iterdir(), *self.home.joinpath(".local").rglob("*"), self.home / ".local"]:
            os.lchown(p, pw.pw_uid, pw.pw_gid)
        (self.pc / "sshd_config").write_text(
            f"Port {self.port}\nListenAddress 127.0.0.1\nHostKey {self.pc / 'host_key'}\n"
            f"PidFile {self.pc / 'sshd.pid'}\nAuthorizedKeysFile .ssh/authorized_keys\nPasswordAuthentication no\n"
            f"KbdInteractiveAuthentication no\nUsePAM no\nStrictModes yes\nAllowUsers {self.user}\n"
            "Subsystem sftp internal-sftp\n")
        (self.pc / "known_hosts").write_text(f"[127.0.0.1]:{self.port} {(self.pc / 'host_key.pub').read_text()}")
        self.ssh_config = self.pc / "ssh_config"
        self.ssh_config.write_text(
            f"Host {self.alias}\n  HostName 127.0.0.1\n  Port {self.port}\n  User {self.user}\n"
            f"  IdentityFile {self.pc / 'id'}\n  IdentitiesOnly yes\n  UserKnownHostsFile {self.pc / 'known_hosts'}\n"
            f"  StrictHostKeyChecking yes\n"
            f"Host {self.alias}-down\n  HostName 127.0.0.1\n  Port {free_port()}\n  User {self.user}\n"
            f"  IdentityFile {self.pc / 'id'}\n  UserKnownHostsFile {self.pc / 'known_hosts'}\n")
        Path("/run/sshd").mkdir(exist_ok=True)    # sshd's privilege separation directory
        self.proc = subprocess.Popen([SSHD, "-D", "-e", "-f", str(self.pc / "sshd_config")],
                                     stdout=subprocess.DEVNULL, stderr=open(self.pc / "sshd.log", "wb"))

        def listening() -> bool:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.2).close()
                return True
            except OSError:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"sshd exited: {(self.pc / 'sshd.log').read_text()}")
                return False
        if not wait_until(listening, timeout=10):
            raise RuntimeError("sshd did not listen within 10 s")
        return self

    def _device_python_has_deps(self) -> None:
        """The user's site directory sees this checkout's .venv packages (not the kit itself)."""
        venv_site = Path(sysconfig.get_paths()["purelib"])
        for parent in venv_site.parents:        # e.g. a checkout under /root (mode 700)
            if not parent.stat().st_mode & 0o001:
                raise RuntimeError(f"the device's user cannot reach this checkout's packages in {venv_site}: "
                                   f"{parent} is closed to other users (mode {parent.stat().st_mode & 0o777:o}); "
                                   f"run the tests from a checkout outside it (e.g. /work or /srv), "
                                   f"or `chmod o+x {parent}`")
        deps = self.base / "system-site"
        deps.mkdir()
        for p in venv_site.iterdir():
            if not p.name.startswith(NOT_DEPS) and p.suffix != ".pth":
                (deps / p.name).symlink_to(p)
        ver = f"python{sys.version_info.major}.{sys.version_info.minor}"
        site = self.home / ".local" / "lib" / ver / "site-packages"
        site.mkdir(parents=True)
        (site / "starsun-device-deps.pth").write_text(f"{deps}\n")

    @property
    def python(self) -> str:
        """The device's interpreter: this Python's version (the .venv's compiled packages need it),
        from a place the device's user may run (not under /root)."""
        ver = f"python{sys.version_info.major}.{sys.version_info.minor}"
        for cand in (f"/usr/bin/{ver}", f"/usr/local/bin/{ver}", getattr(sys, "_base_executable", "")):
            if cand and os.access(cand, os.X_OK) and not cand.startswith("/root/"):
                return cand
        raise RuntimeError(f"no {ver} outside /root for the device's user: install it (apt-get install {ver})")

    def ssh(self, script: str) -> str:
        return _run("ssh", "-F", str(self.ssh_config), "-o", "BatchMode=yes", self.alias, script).stdout

    def as_user(self, argv, **kw) -> subprocess.Popen:
        """Start a process as the device's user (what systemd would do with the unit)."""
        env = {"HOME": str(self.home), "PATH": "/usr/bin:/bin", "USER": self.user, "PYTHONUNBUFFERED": "1"}
        runuser = shutil.which("runuser") or "/usr/sbin/runuser"
        return subprocess.Popen([runuser, "-u", self.user, "--", *argv], env=env, **kw)

    def snapshot(self) -> dict:
        """{path: (size, mtime_ns)} of everything in the user's home."""
        out = {}
        for p in sorted(self.home.rglob("*")):
            st = p.lstat()
            out[str(p.relative_to(self.home))] = (st.st_size, st.st_mtime_ns)
        return out

    def close(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(10)
        subprocess.run(["userdel", "-r", "-f", self.user], capture_output=True)
        shutil.rmtree(self.base, ignore_errors=True)
