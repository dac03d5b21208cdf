"""The two files provisioning writes for the agent: its config (TOML, read by
`edge-agent run --config`) and the systemd unit that runs it.

A system unit (/etc/systemd/system, User=) when the ssh user may sudo; else a user unit
(~/.config/systemd/user), which starts at boot only with `loginctl enable-linger USER`.
A usage error (exit 2: a bad config) does not fix itself, so it is not restarted.
"""
from __future__ import annotations

import json
import shlex
from dataclasses import dataclass
from typing import Dict, Optional

UNIT_NAME = "starsun-agent.service"


@dataclass(frozen=True)
class Layout:
    """Where things live on the device (all absolute: systemd and the config need them so)."""
    home: str
    root: str = ""

    def __post_init__(self):
        if not self.root:
            object.__setattr__(self, "root", f"{self.home}/starsun")

    @property
    def venv(self) -> str:
        return f"{self.root}/venv"

    @property
    def config(self) -> str:
        return f"{self.root}/agent.toml"

    @property
    def install_stamp(self) -> str:
        return f"{self.root}/install.sha256"

    def unit_path(self, system: bool) -> str:
        return f"/etc/systemd/system/{UNIT_NAME}" if system else f"{self.home}/.config/systemd/user/{UNIT_NAME}"

    def wants_dir(self, system: bool) -> str:
        """Where `systemctl enable` links the unit (its WantedBy target's .wants directory)."""
        return ("/etc/systemd/system/multi-user.target.wants" if system
                else f"{self.home}/.config/systemd/user/default.target.wants")


def _toml_value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    return json.dumps(str(v))          # a JSON string is a TOML basic string


def agent_config(values: Dict[str, object], source: str) -> str:
    """The TOML text of `edge-agent run --config` (None values are left out)."""
    lines = [f"# written by `make flash-jetson` ({source}); `edge-agent run --config` reads it.",
             "# No secrets here: credentials are files (password_file, tls_dir, ctl_key_file)."]
    lines += [f"{k} = {_toml_value(v)}" for k, v in values.items() if v is not None]
    return "\n".join(lines) + "\n"


def exec_start(layout: Layout) -> str:
    return f"{shlex.quote(layout.venv + '/bin/edge-agent')} run --config {shlex.quote(layout.config)}"


def unit_text(layout: Layout, role: str, client_id: str, hub: str, system: bool, user: Optional[str]) -> str:
    after = "Wants=network-online.target\nAfter=network-online.target\n" if system else ""
    who = f"User={user}\n" if system and user else ""
    return (f"[Unit]\nDescription=StarSun edge agent: {role} {client_id} -> {hub}\n{after}\n"
            f"[Service]\nType=exec\n{who}WorkingDirectory={layout.root}\n"
            f"Environment=PYTHONUNBUFFERED=1\nExecStart={exec_start(layout)}\n"
            "Restart=on-failure\nRestartSec=5\nRestartPreventExitStatus=2\n\n"
            f"[Install]\nWantedBy={'multi-user.target' if system else 'default.target'}\n")


def exec_start_of(unit: str) -> str:
    """The ExecStart= line of a unit's text (what tests and `systemctl` run)."""
    for line in unit.splitlines():
        if line.startswith("ExecStart="):
            return line[len("ExecStart="):]
    raise ValueError("the unit has no ExecStart= line")
