"""An arm64 Debian root on this x86 machine, run through qemu-user, with an sshd on a loopback
port: a stand-in for a Jetson's CPU side that `make flash-jetson` can provision
(benchmarks/device/aarch64_device.py drives it).

What it takes from the host, and gives back at close():
  * apt packages qemu-user-static, debootstrap, binfmt-support (installed if missing; kept);
  * binfmt_misc: mounted on /proc/sys/fs/binfmt_misc if it is not (a container often has it
    unmounted: debootstrap then says "Unable to execute target architecture"), and qemu-aarch64
    enabled there; each is undone at close() only if this run did it. The registration has the
    F flag (fix binary): the kernel opens the interpreter once, so the root needs no copy of it;
  * /proc, /sys, /dev and /dev/pts mounted into the root while it runs (onnxruntime reads
    /proc/cpuinfo and /sys; sshd needs /dev/null and ptys), unmounted at close();
  * the device's /etc/pip.conf: this machine's, plus a constraint on what qemu cannot run
    (QEMU_CONSTRAINTS);
  * an sshd inside the root on 127.0.0.1:PORT (the root shares this machine's network, so the
    device reaches a hub on 127.0.0.1 too), killed at close() with every process still running
    in the root (by pid, found through /proc/PID/root).
The root itself stays (reused by the next run: debootstrap takes minutes) unless remove=True.
"""
from __future__ import annotations

import configparser
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path
from typing import Callable, List, Optional

from harness.ssh_device import free_port
from harness.waiting import wait_until

BINFMT = Path("/proc/sys/fs/binfmt_misc")
APT_PACKAGES = ("qemu-user-static", "debootstrap", "binfmt-support")
# what a JetPack image has that provisioning needs: python3 with venv, sshd, rsync
ROOT_PACKAGES = ("openssh-server", "python3", "python3-venv", "rsync", "ca-certificates", "procps")
# what the emulation cannot run, kept out of the device's pip (not the kit's requirements: a real
# aarch64 board runs the newest); found by bisecting: 1.27.0 imports under qemu, 1.28.0 segfaults
QEMU_CONSTRAINTS = ("onnxruntime<1.28",)
DEVICE_USER = "nvidia"           # JetPack's default user
READY = ".starsun-root-ready"    # written once debootstrap and the user are done


def _run(argv: List[str], **kw) -> subprocess.CompletedProcess:
    r = subprocess.run(argv, capture_output=True, text=True, **kw)
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed ({r.returncode}): {(r.stderr or r.stdout).strip()[-2000:]}")
    return r


def debian_mirror() -> str:
    """The Debian mirror this machine's apt uses (a deb822 or a one-line sources file)."""
    for f in sorted(Path("/etc/apt").glob("sources.list.d/*.sources")) + [Path("/etc/apt/sources.list")]:
        for line in (f.read_text().splitlines() if f.is_file() else ()):
            words = line.split()
            if line.startswith("URIs:") and "security" not in line:
                return words[1]
            if words[:1] == ["deb"] and "security" not in line:
                return next(w for w in words[1:] if w.startswith("http"))
    return "http://deb.debian.org/debian"


class Arm64Root:
    def __init__(self, path: Path, say: Callable[[str], None] = print, suite: str = "bookworm"):
        self.path, self.say, self.suite = Path(path), say, suite
        self.pc = self.path.parent / "pc"               # the PC's side: keys, known_hosts, ssh config
        self.mounted: List[Path] = []
        self.mounted_binfmt = False
        self.enabled_qemu = False
        self.sshd: Optional[subprocess.Popen] = None
        self.port = 0
        self.ssh_config = self.pc / "ssh_config"
        self.alias = "starsun-arm64"

    @property
    def home(self) -> Path:
        """The device user's home, as this machine sees it."""
        return self.path / "home" / DEVICE_USER

    # ---- host side ----
    def ensure_tools(self) -> str:
        missing = [p for p, exe in zip(APT_PACKAGES, ("qemu-aarch64-static", "debootstrap", "update-binfmts"))
                   if not shutil.which(exe)]
        if missing:
            self.say(f"  apt-get install {' '.join(missing)}")
            _run(["apt-get", "install", "-y", "-q", *missing], env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"})
        return "qemu-user-static, debootstrap, binfmt-support " + ("installed now" if missing else "present")

    def ensure_binfmt(self) -> str:
        if not (BINFMT / "status").exists():
            _run(["mount", "-t", "binfmt_misc", "binfmt_misc", str(BINFMT)])
            self.mounted_binfmt = True
        entry = BINFMT / "qemu-aarch64"
        if not entry.exists() or not entry.read_text().startswith("enabled"):
            _run(["update-binfmts", "--enable", "qemu-aarch64"])
            self.enabled_qemu = True
        flags = next((ln.split()[1] for ln in entry.read_text().splitlines() if ln.startswith("flags:")), "")
        if "F" not in flags:
            raise RuntimeError(f"qemu-aarch64 is registered without the F flag ({flags!r}): a chroot cannot "
                               "find the interpreter; reinstall qemu-user-static (Debian's registers it with F)")
        return (f"binfmt_misc {'mounted now' if self.mounted_binfmt else 'already mounted'}, qemu-aarch64 "
                f"{'enabled now' if self.enabled_qemu else 'already enabled'} (flags {flags})")

    def bootstrap(self) -> str:
        if (self.path / READY).is_file():
            return f"reused {self.path} ({self._du(self.path)} MiB)"
        if self.path.exists():
            self.say(f"  {self.path} is a partial root: removing it")
            self._rmtree_root()
        mirror = debian_mirror()
        self.say(f"  debootstrap --arch=arm64 --variant=minbase {self.suite} from {mirror} (minutes)")
        _run(["debootstrap", "--arch=arm64", "--variant=minbase", "--include=" + ",".join(ROOT_PACKAGES),
              self.suite, str(self.path), mirror])
        arch = _run(["chroot", str(self.path), "uname", "-m"]).stdout.strip()
        if arch != "aarch64":
            raise RuntimeError(f"the root runs as {arch}, not aarch64: is qemu-aarch64 registered?")
        self._chroot("useradd", "-m", "-s", "/bin/bash", DEVICE_USER)
        self._chroot("usermod", "-p", "*", DEVICE_USER)     # no password, not locked: its key logs in
        (self.path / READY).write_text("ok\n")
        return f"made {self.path} ({self._du(self.path)} MiB)"

    def _du(self, p: Path) -> int:
        return int(_run(["du", "-sxm", str(p)]).stdout.split()[0])

    def _chroot(self, *argv: str) -> str:
        return _run(["chroot", str(self.path), *argv]).stdout

    def remove(self) -> str:
        self._rmtree_root()
        return f"removed {self.path}"

    def _rmtree_root(self) -> None:
        for m in ("dev/pts", "dev", "sys", "proc"):     # never delete through a mount
            if os.path.ismount(self.path / m):
                raise RuntimeError(f"{self.path / m} is mounted: unmount it first")
        shutil.rmtree(self.path)

    # ---- the running device ----
    def mount(self) -> str:
        for src, rel, argv in (("proc", "proc", ["-t", "proc"]), ("sysfs", "sys", ["-t", "sysfs"]),
                               ("/dev", "dev", ["--bind"]), ("/dev/pts", "dev/pts", ["--bind"])):
            target = self.path / rel
            if not os.path.ismount(target):
                _run(["mount", *argv, src, str(target)])
                self.mounted.append(target)
        for f in ("/etc/resolv.conf", "/etc/ssl/certs/ca-certificates.crt"):
            if Path(f).is_file():        # pip on the device reaches the index as this machine does
                shutil.copyfile(f, self.path / f.lstrip("/"))
        self._pip_config()
        return f"mounted {', '.join('/' + str(m.relative_to(self.path)) for m in self.mounted) or 'nothing new'}"

    def _pip_config(self) -> None:
        """The device's /etc/pip.conf: this machine's (its certificate bundle) plus QEMU_CONSTRAINTS."""
        cfg = configparser.ConfigParser()
        cfg.read("/etc/pip.conf")
        (self.path / "etc/pip-constraints-qemu.txt").write_text(
            "# qemu-user 7.2 (Debian 12) segfaults loading onnxruntime >= 1.28's aarch64 build; 1.27.0 loads\n"
            + "\n".join(QEMU_CONSTRAINTS) + "\n")
        if not cfg.has_section("install"):
            cfg.add_section("install")
        cfg.set("install", "constraint", "/etc/pip-constraints-qemu.txt")
        with open(self.path / "etc/pip.conf", "w") as f:
            cfg.write(f)

    def start_sshd(self) -> str:
        self.pc.mkdir(mode=0o700, exist_ok=True)
        for key in ("id", "host_key"):
            if not (self.pc / key).exists():
                _run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(self.pc / key)])
        ssh_dir = self.home / ".ssh"
        ssh_dir.mkdir(mode=0o700, exist_ok=True)
        shutil.copyfile(self.pc / "id.pub", ssh_dir / "authorized_keys")
        self._chroot("chown", "-R", f"{DEVICE_USER}:{DEVICE_USER}", f"/home/{DEVICE_USER}/.ssh")
        etc = self.path / "etc/ssh"
        shutil.copyfile(self.pc / "host_key", etc / "starsun_host_key")
        os.chmod(etc / "starsun_host_key", 0o600)
        self.port = free_port()
        (etc / "starsun_sshd_config").write_text(
            f"Port {self.port}\nListenAddress 127.0.0.1\nHostKey /etc/ssh/starsun_host_key\n"
            "PidFile /run/starsun_sshd.pid\nAuthorizedKeysFile .ssh/authorized_keys\nPasswordAuthentication no\n"
            f"KbdInteractiveAuthentication no\nUsePAM no\nAllowUsers {DEVICE_USER}\nSubsystem sftp internal-sftp\n")
        (self.path / "run/sshd").mkdir(parents=True, exist_ok=True)
        (self.pc / "known_hosts").write_text(f"[127.0.0.1]:{self.port} {(self.pc / 'host_key.pub').read_text()}")
        self.ssh_config.write_text(
            f"Host {self.alias}\n  HostName 127.0.0.1\n  Port {self.port}\n  User {DEVICE_USER}\n"
            f"  IdentityFile {self.pc / 'id'}\n  IdentitiesOnly yes\n  UserKnownHostsFile {self.pc / 'known_hosts'}\n"
            "  StrictHostKeyChecking yes\n  ConnectTimeout 60\n")
        log = open(self.pc / "sshd.log", "wb")
        self.sshd = subprocess.Popen(["chroot", str(self.path), "/usr/sbin/sshd", "-D", "-e",
                                      "-f", "/etc/ssh/starsun_sshd_config"], stdout=subprocess.DEVNULL, stderr=log)
        if not wait_until(lambda: self._answers(), timeout=120):
            raise RuntimeError(f"the root's sshd did not answer within 120 s: {(self.pc / 'sshd.log').read_text()}")
        return (f"sshd (aarch64, emulated) on 127.0.0.1:{self.port}, pid {self.sshd.pid}; "
                f"ssh -F {self.ssh_config} {self.alias}")

    def _answers(self) -> bool:
        if self.sshd.poll() is not None:
            raise RuntimeError(f"the root's sshd exited: {(self.pc / 'sshd.log').read_text()}")
        r = subprocess.run(self.ssh_argv("uname -m"), capture_output=True, text=True)
        if r.returncode != 0:
            time.sleep(1)               # each try forks an emulated sshd: not 50 a second
        return r.returncode == 0 and r.stdout.strip() == "aarch64"

    def run_as_user(self, command: str, log: Path) -> subprocess.Popen:
        """`command` in the root as the device's user from its home, as systemd runs a user unit
        (no systemd runs in the root); its output to `log`."""
        env = ["HOME=/home/" + DEVICE_USER, "USER=" + DEVICE_USER, "PATH=/usr/bin:/bin", "PYTHONUNBUFFERED=1"]
        with open(log, "wb") as f:
            return subprocess.Popen(["chroot", f"--userspec={DEVICE_USER}:{DEVICE_USER}", str(self.path),
                                     "/usr/bin/env", "-i", *env, "sh", "-c", f"cd ~/starsun && exec {command}"],
                                    stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)

    def ssh_argv(self, script: str) -> List[str]:
        return ["ssh", "-F", str(self.ssh_config), "-o", "BatchMode=yes", self.alias, script]

    def ssh(self, script: str, timeout: float = 600) -> str:
        return _run(self.ssh_argv(script), timeout=timeout).stdout

    # ---- giving everything back ----
    def processes(self) -> List[int]:
        """Pids of processes running inside the root (sshd, its sessions, the agent)."""
        out = []
        for d in Path("/proc").iterdir():
            if d.name.isdigit():
                try:
                    if os.readlink(d / "root") == str(self.path):
                        out.append(int(d.name))
                except OSError:
                    continue
        return out

    def close(self, remove: bool = False) -> List[str]:
        notes = []
        pids = self.processes()
        for pid in pids:
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        if pids and not wait_until(lambda: not self.processes(), timeout=20):
            for pid in self.processes():
                os.kill(pid, signal.SIGKILL)
            wait_until(lambda: not self.processes(), timeout=10)
        if self.sshd is not None:
            self.sshd.wait(10)
        notes.append(f"stopped {len(pids)} processes in the root" if pids else "no process left in the root")
        for target in reversed(self.mounted):
            if subprocess.run(["umount", str(target)], capture_output=True).returncode != 0:
                time.sleep(1)
                subprocess.run(["umount", "-l", str(target)], capture_output=True)
            notes.append(f"unmounted {target}")
        self.mounted.clear()
        if self.enabled_qemu:
            subprocess.run(["update-binfmts", "--disable", "qemu-aarch64"], capture_output=True)
            notes.append("qemu-aarch64 disabled again")
        if self.mounted_binfmt:
            subprocess.run(["umount", str(BINFMT)], capture_output=True)
            notes.append(f"unmounted {BINFMT}")
        if remove:
            self._rmtree_root()
            shutil.rmtree(self.pc, ignore_errors=True)
            notes.append(f"removed {self.path}")
        return notes
