"""The provisioning steps, in order. The first three only look (the PC's USB, the artifact against
the budget, the device); nothing on the device changes before all three pass. Every step after
them compares hashes with what the device has and changes only what differs, so a second run
changes nothing and says so, and a failed run is resumed by running the same command again.
"""
from __future__ import annotations

import hashlib
import shlex
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Optional

import click

from devices import agent_files as files
from devices import gpu_confirm
from devices.artifact_check import Artifact, check_artifact
from devices.device_checks import FLASH_HELP, DeviceFacts, check_facts, probe_script, recovery_boards
from devices.endpoint_wait import endpoint_url, wait_answers
from devices.install_recipe import build_wheel, check_command, describe_size, install_commands, venv_size_command
from devices.remote import Remote, changed_files, local_files, sha256_file

MB = 1e6


@dataclass
class Options:
    device: str
    profile: object                     # DeviceProfile
    role: str
    hub: str
    model: Optional[str] = None
    bundle: Optional[str] = None
    module: Optional[str] = None
    backend: str = "auto"
    client_id: Optional[str] = None
    max_len: Optional[int] = None
    max_sessions: int = 64
    max_batch: int = 64
    memory_budget: Optional[str] = None
    username: Optional[str] = None
    password_file: Optional[str] = None
    tls_files: Optional[tuple] = None   # (ca, cert, key) on the PC, for an mqtts:// hub
    ctl_key_file: Optional[str] = None
    extra: Dict[str, object] = field(default_factory=dict)   # more `edge-agent run` options
    deps: str = "pypi"
    wheel: Optional[str] = None
    wheels_dir: Optional[str] = None
    ort_index: Optional[str] = None
    device_python: str = "python3"
    ssh_config: Optional[str] = None
    wait: bool = True
    timeout: float = 180.0
    watch: dict = field(default_factory=dict)  # username, password, tls of the watch on the PC
    watch_hub: Optional[str] = None     # the hub's broker as the PC reaches it (default: hub)


def _major_minor(version: str) -> str:
    """"3.11.2" -> "3.11" (the markers' python_version); "" (not probed) -> the plan's default."""
    return ".".join(version.split(".")[:2]) or "3.10"


class Provisioning:
    def __init__(self, o: Options, echo: Callable[[str], None] = click.echo):
        self.o, self.echo = o, echo
        self.remote = Remote(o.device, o.ssh_config)
        self.changed: List[str] = []
        self.artifact: Optional[Artifact] = None
        self.facts: Optional[DeviceFacts] = None
        self.layout: Optional[files.Layout] = None
        self.wheel: Optional[Path] = None
        self.watch = None
        self._tmp = tempfile.TemporaryDirectory(prefix="starsun-wheel-")

    @property
    def client_id(self) -> str:
        return self.o.client_id or "".join(c if c.isalnum() or c in "-_." else "-" for c in self.facts.host)[:64]

    @property
    def system(self) -> bool:
        return self.facts.sudo

    def steps(self):
        return [("no Jetson in USB recovery mode on this PC", self.check_usb),
                ("the artifact fits the profile", self.check_artifact),
                ("the device is ready", self.check_device),
                ("the kit's wheel", self.build),
                ("files on the device", self.push),
                ("the venv on the device", self.install),
                ("the agent's config", self.write_config),
                ("the systemd unit", self.write_unit),
                ("the agent is running", self.start),
                ("the agent has joined the hub", self.wait_joined)]

    # ---- checks (nothing changes) ----
    def check_usb(self) -> str:
        boards = recovery_boards()
        if boards:
            raise click.ClickException(f"{', '.join(boards)} is in USB recovery mode.\n{FLASH_HELP}")
        return "none found"

    def check_artifact(self) -> str:
        o = self.o
        for what, path in (("--password-file", o.password_file), ("--ctl-key-file", o.ctl_key_file),
                           ("--wheel", o.wheel), ("--wheels", o.wheels_dir)):
            if path and not Path(path).exists():
                raise click.ClickException(f"{what} {path}: no such file or directory")
        self.artifact = check_artifact(o.role, o.profile.name, o.model, o.bundle, o.module, o.backend,
                                       o.memory_budget, o.max_len, o.max_sessions, o.max_batch)
        return self.artifact.summary

    def check_device(self) -> str:
        o = self.o
        try:
            self.facts = DeviceFacts.parse(self.remote.sh(probe_script(o.device_python)))
        except Exception as e:
            raise click.ClickException(f"cannot reach {o.device} over ssh (BatchMode, no password prompt): {e}\n"
                                       "  check the address, that sshd runs there and that your key is on it "
                                       f"(ssh-copy-id {o.device})") from None
        need_disk = self.artifact.bytes + (2e9 if o.deps == "pypi" else 50 * MB)
        stop, warn = check_facts(self.facts, o.profile, o.device_python, need_disk, self.artifact.plan_bytes)
        for w in warn:
            self.echo(f"      warning: {w}")
        if stop:
            raise click.ClickException("the device is not ready:\n  - " + "\n  - ".join(stop))
        self.layout = files.Layout(self.facts.home)
        self.remote.rsync = self.facts.rsync and bool(shutil.which("rsync"))   # rsync needs both ends
        f = self.facts
        return (f"{f.user}@{f.host}: {f.board or f.arch}, Python {f.python}, {f.mem_total / 1e9:.1f} GB RAM "
                f"({f.mem_available / 1e9:.1f} available), {f.disk_bytes / 1e9:.1f} GB free, "
                f"{'sudo' if f.sudo else 'no sudo'}, systemd {'running' if f.systemd else 'not running'}")

    # ---- changes (each compares first) ----
    def build(self) -> str:
        if self.o.wheel:
            self.wheel = Path(self.o.wheel)
            return f"{self.wheel.name} (given)"
        self.wheel = build_wheel(Path(self._tmp.name))
        return f"{self.wheel.name} built, sha256 {sha256_file(self.wheel)[:12]}"

    def _artifact_remote(self) -> str:
        return f"{self.layout.root}/artifacts/{self.artifact.path.name}"

    def _groups(self) -> List[tuple]:
        """(local source, remote dir it goes into, [(local file, remote file)])."""
        root, out = self.layout.root, []
        out.append((self.wheel, f"{root}/wheels", [(self.wheel, f"{root}/wheels/{self.wheel.name}")]))
        a = self.artifact.path
        rem = self._artifact_remote()
        pairs = [(a, rem)] if a.is_file() else [(p, f"{rem}/{p.relative_to(a).as_posix()}") for p in local_files(a)]
        out.append((a, f"{root}/artifacts", pairs))
        if self.o.wheels_dir:
            w = Path(self.o.wheels_dir)
            out.append((w, f"{root}/wheels", [(p, f"{root}/wheels/{w.name}/{p.relative_to(w).as_posix()}")
                                              for p in local_files(w)]))
        return out

    def _secrets(self) -> List[tuple]:
        """(local file, remote file): written with mode 600 through ssh's stdin, never as arguments.
        Only this client's certificate and key and the CA's certificate go (never ca.key)."""
        cred, o = f"{self.layout.root}/credentials", self.o
        out = [(Path(o.password_file), f"{cred}/mqtt.password")] if o.password_file else []
        out += [(Path(p), f"{cred}/tls/{Path(p).name}") for p in (o.tls_files or ())]
        out += [(Path(o.ctl_key_file), f"{cred}/ctl.key")] if o.ctl_key_file else []
        return out

    def push(self) -> str:
        sent, n = [], 0
        for src, remote_dir, pairs in self._groups():
            n += len(pairs)
            todo = changed_files(self.remote, pairs)
            if todo:
                self.remote.push(src, remote_dir)
                sent.append(f"{src.name} ({sum(p.stat().st_size for p, _ in todo) / MB:.1f} MB)")
        secrets = self._secrets()
        for loc, rem in changed_files(self.remote, secrets):
            self.remote.write(rem, loc.read_bytes(), mode="600")
            sent.append(Path(rem).name)
        n += len(secrets)
        if not sent:
            return f"unchanged ({n} files, hashes match)"
        self.changed.append("files")
        return f"sent {', '.join(sent)} with {'rsync' if self.remote.rsync else 'scp'}"

    def install_commands(self) -> List[str]:
        o, root = self.o, self.layout.root
        wheels = f"{root}/wheels/{Path(o.wheels_dir).name}" if o.wheels_dir else None
        return install_commands(o.profile, self.artifact.backend, o.deps, root, o.device_python, self.wheel,
                                wheels, o.ort_index, system_pip=self.facts.pip,
                                python_version=_major_minor(self.facts.python), machine=self.facts.arch or None)

    def install(self) -> str:
        cmds = self.install_commands()
        stamp = hashlib.sha256("\n".join([sha256_file(self.wheel)] + cmds).encode()).hexdigest()
        lay = self.layout
        have = self.remote.sh(f"[ -x {shlex.quote(lay.venv)}/bin/python ] && cat {shlex.quote(lay.install_stamp)} "
                              "2>/dev/null; true").strip()
        result = "unchanged (the installed wheel and commands match)"
        if have != stamp:
            for c in cmds:
                self.echo(f"      $ {c}")
                self.remote.sh(c)
            self.remote.write(lay.install_stamp, (stamp + "\n").encode())
            self.changed.append("venv")
            result = f"installed {self.wheel.name} into {lay.venv} ({len(cmds)} commands)"
        try:
            self.remote.sh(check_command(lay.root, self.artifact.backend, self.o.profile))
        except Exception as e:
            raise click.ClickException(f"the agent does not start on the device: {e}\n  with --deps device the "
                                       "device's Python must already have the kit's dependencies; else use "
                                       "--deps pypi (or --wheels DIR)") from None
        size = self.remote.sh(venv_size_command(lay.root), check=False)   # what the role's install cost
        return f"{result}; {describe_size(size)}"

    def config_values(self) -> dict:
        o, lay = self.o, self.layout
        cred = f"{lay.root}/credentials"
        tls_dir = f"{cred}/tls" if o.tls_files else None
        values = {"role": o.role, "broker": o.hub, "client_id": self.client_id,
                  ("module" if o.role in ("prefill", "decoder") else "model"): self._artifact_remote(),
                  "backend": self.artifact.backend,
                  "profile": o.profile.name, "memory_budget": o.memory_budget, "max_len": o.max_len,
                  "max_sessions": o.max_sessions if o.role == "draft" else None,
                  "max_batch": o.max_batch if o.role == "decoder" else None,
                  "username": o.username or (self.client_id if o.password_file else None),
                  "password_file": f"{cred}/mqtt.password" if o.password_file else None,
                  "tls_dir": tls_dir, "ctl_key_file": f"{cred}/ctl.key" if o.ctl_key_file else None}
        # where the model runs, from the profile (a GPU profile: explicitly on the GPU; --set overrides)
        placement = gpu_confirm.placement_values(o.profile, self._backend())
        return {**values, **placement, **o.extra}

    def _backend(self) -> str:
        """What the agent runs: resolved by check_artifact with the agent's own `auto` rule."""
        return self.artifact.backend

    def _write_if_changed(self, path: str, text: str, what: str, sudo: bool = False) -> bool:
        data = text.encode()
        if self.remote.sha256([path]).get(path) == hashlib.sha256(data).hexdigest():
            return False
        self.remote.write(path, data, sudo=sudo)
        self.changed.append(what)
        return True

    def write_config(self) -> str:
        lay = self.layout
        text = files.agent_config(self.config_values(), f"profile {self.o.profile.name}")
        done = self._write_if_changed(lay.config, text, "config")
        try:        # the device's own agent reads it (--config is eager: it fails before --help prints)
            self.remote.sh(f"{shlex.quote(lay.venv + '/bin/edge-agent')} run --config {shlex.quote(lay.config)} "
                           "--help >/dev/null")
        except Exception as e:
            raise click.ClickException(f"the agent on the device refuses {lay.config}: {e}") from None
        return f"{'wrote' if done else 'unchanged:'} {lay.config}"

    def unit(self) -> str:
        return files.unit_text(self.layout, self.o.role, self.client_id, self.o.hub, self.system, self.facts.user)

    def _systemctl(self) -> str:
        return "sudo -n systemctl" if self.system else "systemctl --user"

    def write_unit(self) -> str:
        lay, sysd, q = self.layout, self.system, shlex.quote
        path = lay.unit_path(sysd)
        wrote = self._write_if_changed(path, self.unit(), "unit", sudo=sysd)
        link = f"{lay.wants_dir(sysd)}/{files.UNIT_NAME}"
        notes = [f"{'wrote' if wrote else 'unchanged:'} {path}"]
        enabled = self.remote.sh(f"[ -L {q(link)} ] && echo yes; true").strip() == "yes"
        if self.facts.systemd and (wrote or not enabled):
            self.remote.sh(f"{self._systemctl()} daemon-reload && {self._systemctl()} enable {files.UNIT_NAME}")
            notes.append("enabled")
        elif not enabled:       # no systemd running (a container): link it as `enable` would, for the next boot
            pre = "sudo -n " if sysd else ""
            self.remote.sh(f"{pre}mkdir -p {q(lay.wants_dir(sysd))} && {pre}ln -sf {q(path)} {q(link)}")
            notes.append("enabled (linked; systemd is not running there)")
        if not sysd:
            notes.append(self._linger())
        return ", ".join(notes)

    def _linger(self) -> str:
        user = shlex.quote(self.facts.user)
        if not self.facts.systemd:
            return f"linger not set (no systemd running; on a systemd boot: loginctl enable-linger {self.facts.user})"
        if self.remote.sh(f"loginctl show-user {user} -p Linger --value 2>/dev/null; true").strip() == "yes":
            return "linger already on (the user unit starts at boot)"
        try:
            self.remote.sh(f"loginctl enable-linger {user}")
        except Exception as e:
            raise click.ClickException(f"a user unit starts at boot only with lingering, and `loginctl "
                                       f"enable-linger` failed ({e}): ask an admin for `sudo loginctl enable-linger "
                                       f"{self.facts.user}`, or give the user sudo for a system unit") from None
        self.changed.append("linger")
        return "linger enabled (the user unit starts at boot)"

    def start(self) -> str:
        if self.o.wait:            # subscribe before the agent starts: a target's Joined is not retained
            from devices.join_wait import JoinWatch
            self.watch = JoinWatch(self.o.watch_hub or self.o.hub, self.o.role, self.client_id, **self.o.watch).start()
        if not self.facts.systemd:
            return ("systemd is not running on the device (a container?): the unit starts at its next boot; "
                    f"start the agent now with: {files.exec_start(self.layout)}")
        ctl = f"{self._systemctl()} {{}} {files.UNIT_NAME}"
        if not self.changed and self.remote.sh(ctl.format("is-active") + "; true").strip() == "active":
            return "unchanged, active"
        what = f"restarted ({', '.join(self.changed)} changed)" if self.changed else "started"
        self.remote.sh(ctl.format("restart" if self.changed else "start"))
        self.changed.append("started")
        if self.watch is not None:
            self.watch.forget()
        return what

    def wait_joined(self) -> str:
        """The agent has joined the hub and, for a target, its OpenAI endpoint answers on the device
        (devices/endpoint_wait.py: a client's request between the two would be refused); both
        within --timeout (at least 5 s for the endpoint)."""
        end = time.monotonic() + self.o.timeout
        joined = self._joined()
        url = endpoint_url(self.config_values()) if self.watch is not None else None
        if url is None:
            return joined
        left = max(5.0, end - time.monotonic())
        self.echo(f"      waiting up to {left:.0f} s for the OpenAI endpoint on the device (GET {url})")
        return f"{joined}; {wait_answers(self.remote, self.layout.venv + '/bin/python', url, left)}"

    def _joined(self) -> str:
        if self.watch is None:
            return "not waited for (--no-wait)"
        try:
            if self.o.role == "target" and not self.changed:
                return ("unchanged and not restarted: a target's join is not retained at the hub, so it is "
                        f"not re-checked (see `journalctl{'' if self.system else ' --user'} -u starsun-agent` "
                        "on the device)")
            self.echo(f"      waiting up to {self.o.timeout:.0f} s for {self.o.role} {self.client_id} on {self.o.hub}")
            try:
                joined = self.watch.wait(self.o.timeout)
            except TimeoutError as e:   # an agent that refused its placement (a wrong build) says why at start
                why = gpu_confirm.why_not_joined(self.remote, self._backend(), self.system, self.facts.systemd)
                raise TimeoutError(f"{e}{why}") from None
        finally:
            self.watch.close()
        # the final check: the agent's own start line says where its model runs (a wrong build fails here)
        where = gpu_confirm.confirm_on_gpu(self.remote, self.o.profile, self._backend(), self.system,
                                           self.facts.systemd)
        return f"{joined}; {where}"
