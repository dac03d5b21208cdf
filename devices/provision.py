"""Provision a Jetson-class device: `make flash-jetson DEVICE=user@host [PROFILE=...]`.

Over ssh: check the device's Python, copy a wheel of this kit (and optional
bundles / local wheels, e.g. NVIDIA's onnxruntime-gpu for JetPack), create a
venv, install, and write a systemd unit that runs `edge-agent run` with the
role you choose. `--dry-run` prints every command instead of running it.
Flashing the JetPack image itself is NVIDIA's SDK Manager's job, not ours.
"""
from __future__ import annotations

import shlex
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import List

import click

from devices.profile import list_profiles, load_profile

REPO = Path(__file__).resolve().parent.parent
REMOTE_DIR = "~/starsun"

UNIT = """[Unit]
Description=StarSun edge agent ({role})
After=network-online.target

[Service]
ExecStart={remote}/.venv/bin/edge-agent run --role {role} --hub {hub} {extra}
Restart=always
RestartSec=3

[Install]
WantedBy=default.target
"""


def plan(device: str, profile_name: str, role: str, hub: str, wheel: str, bundle: str | None,
         wheels_dir: str | None, extra: str) -> List[List[str]]:
    """The commands, in order, as argv lists (pure: easy to print and to test)."""
    prof = load_profile(profile_name)
    ssh = ["ssh", "-o", "BatchMode=yes", device]
    cmds = [
        ssh + [f"python{prof.python} -c 'import sys; assert sys.version_info[:2] >= (3, 10)'"],
        ssh + [f"mkdir -p {REMOTE_DIR}/wheels {REMOTE_DIR}/bundles"],
        ["scp", wheel, f"{device}:{REMOTE_DIR}/wheels/"],
    ]
    if wheels_dir:
        cmds.append(["scp", "-r", f"{wheels_dir}/.", f"{device}:{REMOTE_DIR}/wheels/"])
    if bundle:
        cmds.append(["scp", "-r", bundle, f"{device}:{REMOTE_DIR}/bundles/"])
    pip = f"{REMOTE_DIR}/.venv/bin/pip install --find-links {REMOTE_DIR}/wheels"
    # system site packages: JetPack's CUDA-enabled torch lives there
    cmds += [
        ssh + [f"python{prof.python} -m venv --system-site-packages {REMOTE_DIR}/.venv"],
        ssh + [f"{pip} {prof.onnxruntime_package}"],
        ssh + [f"{pip} {REMOTE_DIR}/wheels/{Path(wheel).name}"],
    ]
    unit = UNIT.format(role=role, hub=hub, remote=REMOTE_DIR.replace("~", "%h"), extra=extra)
    cmds += [
        ssh + [f"mkdir -p ~/.config/systemd/user && cat > ~/.config/systemd/user/starsun-agent.service "
               f"<<'EOF'\n{unit}EOF"],
        ssh + ["systemctl --user daemon-reload && systemctl --user enable --now starsun-agent"],
        ssh + [f"{REMOTE_DIR}/.venv/bin/edge-agent --help >/dev/null && echo provisioned"],
    ]
    return cmds


def build_wheel(out: Path) -> str:
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(out), str(REPO)],
                   check=True)
    return str(next(out.glob("starsun-*.whl")))


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--device", required=True, help="ssh destination, e.g. nvidia@jetson.local")
@click.option("--profile", "profile_name", default="jetson-orin-nano-8gb", show_default=True,
              type=click.Choice(list_profiles()))
@click.option("--role", default="target", type=click.Choice(["target", "draft"]), show_default=True)
@click.option("--hub", default="mqtt://hub.local:1883", show_default=True, help="hub broker URL")
@click.option("--bundle", type=click.Path(exists=True), help="exported bundle dir to copy (edge-export bundle)")
@click.option("--wheels", "wheels_dir", type=click.Path(exists=True, file_okay=False),
              help="local wheels for the device (e.g. onnxruntime-gpu for JetPack)")
@click.option("--agent-args", default="", help="extra arguments for `edge-agent run`")
@click.option("--dry-run", is_flag=True, help="print the commands, run nothing")
def main(device, profile_name, role, hub, bundle, wheels_dir, agent_args, dry_run):
    """Install the StarSun edge agent on a Jetson-class device over ssh."""
    with tempfile.TemporaryDirectory() as tmp:
        wheel = "starsun-0.1.0-py3-none-any.whl" if dry_run else build_wheel(Path(tmp))
        cmds = plan(device, profile_name, role, hub, wheel, bundle, wheels_dir, agent_args)
        for i, argv in enumerate(cmds, 1):
            click.echo(f"[{i}/{len(cmds)}] {shlex.join(argv)}")
            if dry_run:
                continue
            r = subprocess.run(argv)
            if r.returncode != 0:
                raise click.ClickException(f"step {i} failed (exit {r.returncode}); fix it and run again "
                                           "(every step is safe to repeat)")
    click.echo("dry run: nothing was changed" if dry_run else f"{device} is provisioned ({role})")


if __name__ == "__main__":
    main()
