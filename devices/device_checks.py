"""What provisioning checks before it changes anything: the PC's USB bus and the device itself.

A Jetson in USB recovery mode (NVIDIA's vendor id 0955, product 7x23 for the Orin family:
7023 / 7223 AGX Orin, 7323 / 7423 Orin NX, 7523 / 7623 Orin Nano; the ids as Seeed Studio's
reComputer flashing guides list them for `lsusb`) has no OS to ssh into: it is a
bare board, flashed with NVIDIA's SDK Manager or l4t_initrd_flash.sh, not by this kit. The
device probe is one read-only ssh call; each check that fails says what to do.
"""
from __future__ import annotations

import re
import shlex
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional

RECOVERY_ID = re.compile(r"0955:(7[0-9a-f]23)", re.I)
ORIN_RECOVERY = {"7023": "Jetson AGX Orin", "7223": "Jetson AGX Orin 32GB", "7323": "Jetson Orin NX 16GB",
                 "7423": "Jetson Orin NX 8GB", "7523": "Jetson Orin Nano 8GB", "7623": "Jetson Orin Nano 4GB"}
SYSFS_USB = Path("/sys/bus/usb/devices")
FLASH_HELP = """\
A Jetson in USB recovery mode is a bare board: this kit provisions a running JetPack, it does not
flash one. Flash JetPack 6 first (NVIDIA's job):
  * SDK Manager (developer.nvidia.com/sdk-manager) on an Ubuntu 20.04/22.04 PC: select the board
    and JetPack 6.x, flash; or
  * the L4T BSP: in Linux_for_Tegra/, e.g. for an Orin Nano dev kit on NVMe:
      sudo ./tools/kernel_flash/l4t_initrd_flash.sh --external-device nvme0n1p1 \\
        -c tools/kernel_flash/flash_l4t_t234_nvme.xml -p "-c bootloader/generic/cfg/flash_t234_qspi.xml" \\
        --showlogs --network usb0 jetson-orin-nano-devkit internal
    (JetPack 6.2's 25 W "super" mode: jetson-orin-nano-devkit-super; other boards: NVIDIA's
    Jetson Linux Developer Guide, "Flashing Support")
Then boot it, finish the first-boot setup, enable ssh and put your key on it (ssh-copy-id USER@HOST),
and run make flash-jetson again."""


def recovery_boards(sysfs: Path = SYSFS_USB, lsusb_text: Optional[str] = None) -> List[str]:
    """Descriptions of NVIDIA boards in recovery mode on this PC's USB (lsusb's text, or sysfs)."""
    found = set()
    if lsusb_text is None and shutil.which("lsusb"):
        lsusb_text = subprocess.run(["lsusb"], capture_output=True, text=True).stdout
    for m in RECOVERY_ID.finditer(lsusb_text or ""):
        found.add(m.group(1).lower())
    for dev in (sysfs.glob("*") if sysfs.is_dir() else ()):
        try:
            vid = (dev / "idVendor").read_text().strip().lower()
            pid = (dev / "idProduct").read_text().strip().lower()
        except OSError:
            continue
        if vid == "0955" and RECOVERY_ID.fullmatch(f"0955:{pid}"):
            found.add(pid)
    return [f"{ORIN_RECOVERY.get(p, 'an NVIDIA Jetson')} (USB 0955:{p})" for p in sorted(found)]


def probe_script(python: str) -> str:
    """One sh script that prints key=value facts about the device and changes nothing."""
    py = shlex.quote(python)
    return "; ".join([
        'echo "home=$HOME"', 'echo "user=$(id -un)"', 'echo "host=$(hostname -s 2>/dev/null || hostname)"',
        'echo "arch=$(uname -m)"',
        f"{py} -c 'import sys; print(\"python=%d.%d.%d\" % sys.version_info[:3])' 2>/dev/null || echo python=",
        f"{py} -c 'import venv, ensurepip' >/dev/null 2>&1 && echo venv=yes || echo venv=no",
        f"{py} -c 'import pip' >/dev/null 2>&1 && echo pip=yes || echo pip=no",
        'echo "disk_kb=$(df -Pk "$HOME" | awk \'NR==2 {print $4}\')"',
        "awk '/^(MemTotal|MemAvailable):/ {sub(\":\", \"\", $1); print tolower($1) \"=\" $2}' /proc/meminfo",
        'echo "rsync=$(command -v rsync >/dev/null && echo yes || echo no)"',
        'echo "sha256sum=$(command -v sha256sum >/dev/null && echo yes || echo no)"',
        'echo "sudo=$(sudo -n true >/dev/null 2>&1 && echo yes || echo no)"',
        'echo "systemd=$([ -d /run/systemd/system ] && echo yes || echo no)"',
        'echo "l4t=$(head -n 1 /etc/nv_tegra_release 2>/dev/null)"',
        "echo \"board=$( (tr -d '\\000' < /proc/device-tree/model) 2>/dev/null)\"",
    ])


@dataclass
class DeviceFacts:
    home: str
    user: str
    host: str
    arch: str
    python: str                 # "3.10.12", "" when the interpreter is missing
    venv: bool
    disk_bytes: int
    mem_total: int
    mem_available: int
    rsync: bool
    sha256sum: bool
    sudo: bool
    systemd: bool
    l4t: str = ""
    board: str = ""
    pip: bool = False           # the interpreter has pip (JetPack's python3-pip): a venv over it needs none
    raw: Dict[str, str] = field(default_factory=dict)

    @classmethod
    def parse(cls, text: str) -> "DeviceFacts":
        kv = dict(line.split("=", 1) for line in text.splitlines() if "=" in line)
        yes = {k: kv.get(k) == "yes" for k in ("venv", "rsync", "sha256sum", "sudo", "systemd", "pip")}
        num = {k: int(kv.get(k) or 0) * 1024 for k in ("disk_kb", "memtotal", "memavailable")}
        return cls(kv.get("home", ""), kv.get("user", ""), kv.get("host", ""), kv.get("arch", ""),
                   kv.get("python", ""), yes["venv"], num["disk_kb"], num["memtotal"], num["memavailable"],
                   yes["rsync"], yes["sha256sum"], yes["sudo"], yes["systemd"], kv.get("l4t", ""),
                   kv.get("board", ""), yes["pip"], kv)


def check_facts(f: DeviceFacts, profile, python: str, need_disk: int, need_memory: int) -> tuple:
    """(problems that stop provisioning, warnings) for these facts against the profile's needs."""
    GB = 1e9
    stop, warn = [], []
    if not f.home.startswith("/"):
        stop.append("the device did not say where its home is (is its login shell POSIX sh?)")
    ver = tuple(int(x) for x in f.python.split(".")[:2]) if f.python else ()
    if not ver:
        stop.append(f"`{python}` does not run on the device: install Python >= 3.10 "
                    "(JetPack 6 ships 3.10) or pass --device-python PATH")
    elif ver < (3, 10):
        stop.append(f"the device's {python} is {f.python}; the kit needs Python >= 3.10 "
                    "(JetPack 5 ships 3.8: move to JetPack 6, or install python3.10 and pass --device-python)")
    elif not f.venv:
        stop.append(f"the device's {python} has no venv/ensurepip: on Ubuntu/JetPack run "
                    f"`sudo apt-get install python3-venv python3-pip` there")
    if not f.sha256sum:
        stop.append("the device has no sha256sum (coreutils): provisioning compares hashes with it")
    if profile.kind == "jetson" and f.arch != "aarch64":
        stop.append(f"profile {profile.name} is a Jetson (aarch64) but the device is {f.arch or 'unknown'}: "
                    "pick the profile of this device (x86-cpu-generic, cpu-2core, ...)")
    elif profile.kind != "jetson" and (f.l4t or "jetson" in f.board.lower()):
        warn.append(f"the device looks like a Jetson ({f.board or f.l4t}) but profile {profile.name} is not one")
    if f.disk_bytes and need_disk > f.disk_bytes:
        stop.append(f"the device has {f.disk_bytes / GB:.2f} GB free in {f.home}; this needs "
                    f"{need_disk / GB:.2f} GB (wheel, artifacts, venv): free some space")
    if f.mem_total and need_memory > f.mem_total:
        stop.append(f"the role's memory plan is {need_memory / GB:.2f} GB but the device has "
                    f"{f.mem_total / GB:.2f} GB in all: this profile does not describe this device")
    elif f.mem_available and need_memory > f.mem_available:
        warn.append(f"the device has {f.mem_available / GB:.2f} GB available now, the role needs "
                    f"{need_memory / GB:.2f} GB: stop what else runs there before it starts")
    return stop, warn
