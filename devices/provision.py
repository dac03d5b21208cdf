"""`make flash-jetson`: put a running device (a Jetson with JetPack, or any Linux box) into the star.

    make flash-jetson SSH=nvidia@jetson.local PROFILE=jetson-orin-nano-8gb ROLE=target \\
        BROKER=mqtt://hub.local:1883 MODEL=qwen2.5-coder-1.5b [DRY=1]
    python -m devices.provision --help

Over ssh (BatchMode: a key, no prompt), in steps (devices/steps.py): check the PC's USB for a
board in recovery mode, the artifact against the profile's memory budget and the device
(Python, architecture, disk, memory) -- nothing changes before these pass; then build the
kit's wheel, push it and the artifact, install into a venv, write the agent's config and a
systemd unit, enable and (re)start it, and wait until the agent has joined the hub (a target:
and its OpenAI endpoint answers on the device, devices/endpoint_wait.py). Each
step compares hashes first: a second run changes nothing and says so. Flashing JetPack
itself is NVIDIA's job (SDK Manager, l4t_initrd_flash.sh): see README, "Provisioning".
"""
from __future__ import annotations

import shlex
import sys
import time

import click

from devices.profile import list_profiles, load_profile
from edge.cli.options import renamed_option

ROLES = ("target", "draft", "prefill", "decoder")


def _extra_options(pairs) -> dict:
    """--set KEY=VALUE: more `edge-agent run` options for the config (values read as TOML). The
    device's own agent checks the keys once the config is there (`run --config F --help`)."""
    if sys.version_info >= (3, 11):
        import tomllib
    else:
        import tomli as tomllib
    from edge.cli.agent_config import SECRET_KEYS
    out = {}
    for p in pairs:
        key, sep, value = p.partition("=")
        key = key.strip().replace("-", "_")
        if not sep or not key:
            raise click.BadParameter(f"{p!r}: give KEY=VALUE, KEY a long option of `edge-agent run` "
                                     "(e.g. http_port=8001)", param_hint="--set")
        if key in SECRET_KEYS:
            raise click.BadParameter(f"{p!r} would put a secret in the config: use --password-file",
                                     param_hint="--set")
        try:
            out[key] = tomllib.loads(f"v = {value}")["v"]
        except tomllib.TOMLDecodeError:
            out[key] = value
    return out


def _watch_credentials(user, password_file, tls_dir, hub) -> dict:
    from edge.cli.broker_options import read_password, tls_files
    password = read_password(None, password_file) if password_file else None
    return {"username": user, "password": password,
            "tls": tls_files(tls_dir, user or "provision", hub) if tls_dir else None}


def print_dry_run(p) -> None:
    """Print what each step would do (the local checks run; the device is not contacted)."""
    from pathlib import Path

    from devices import agent_files as files
    from devices.device_checks import DeviceFacts, probe_script
    from devices.install_recipe import venv_size_command
    o = p.o
    user = o.device.split("@", 1)[0] if "@" in o.device else "USER"
    home = "/root" if user == "root" else f"/home/{user}"
    p.facts = DeviceFacts(home, user, o.client_id or "DEVICE", "aarch64", "", True, 0, 0, 0, True, True, False, False)
    p.layout = files.Layout(home)
    p.wheel = Path(o.wheel) if o.wheel else Path("starsun-0.1.0-py3-none-any.whl")
    p.remote.rsync = True
    for i, (name, fn) in enumerate(p.steps()[:2], 1):
        click.echo(f"[{i}/10] {name}: {fn()}")
    show = [("the device is ready", [shlex.join(p.remote.ssh_argv(probe_script(o.device_python)))]),
            ("the kit's wheel", [f"pip wheel --no-deps (SOURCE_DATE_EPOCH fixed) -> {p.wheel.name}"]),
            ("files on the device", [shlex.join(p.remote.push_argv(src, d)) + "   # only if a hash differs"
                                     for src, d, _ in p._groups()]
             + [f"ssh stdin -> {r} (mode 600)" for _, r in p._secrets()]),
            ("the venv on the device", p.install_commands()
             + [venv_size_command(p.layout.root) + "   # the install size, reported"]),
            ("the agent's config", [f"{p.layout.config}:"] + files.agent_config(
                p.config_values(), f"profile {o.profile.name}").splitlines()),
            ("the systemd unit", [f"{p.layout.unit_path(False)} (user unit; with sudo: "
                                  f"{p.layout.unit_path(True)} with User={user}):"] + p.unit().splitlines()
             + ["systemctl --user daemon-reload && systemctl --user enable starsun-agent.service",
                f"loginctl enable-linger {user}   # a user unit starts at boot only so"]),
            ("the agent is running", ["systemctl --user restart starsun-agent.service   # when anything changed"]),
            ("the agent has joined the hub", [f"watch {o.hub} for {o.role} {p.facts.host} (devices/join_wait.py)"]
             + _endpoint_lines(p))]
    for i, (name, lines) in enumerate(show, 3):
        click.echo(f"[{i}/10] {name} (dry run):")
        for line in lines:
            click.echo(f"      {line}")
    click.echo(f"dry run: nothing was changed on {o.device} (the home is assumed to be {home})")


def _endpoint_lines(p) -> list:
    """What step 10 does after the join for an agent that serves the OpenAI endpoint (a target)."""
    from devices.endpoint_wait import endpoint_url
    url = endpoint_url(p.config_values())
    if url is None:
        return []
    return [f"then on the device: {p.layout.venv}/bin/python GETs {url} until it answers, within --timeout "
            "(devices/endpoint_wait.py)"]


@click.command(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.option("--ssh", "device", required=True, help="the device's ssh destination (user@host or a Host of your ssh config)")
@renamed_option("--device", "--ssh USER@HOST")
@renamed_option("--hub", "--broker mqtt(s)://HOST:PORT")
@renamed_option("--watch-hub", "--watch-broker")
@click.option("--profile", "profile_name", default="jetson-orin-nano-8gb", show_default=True,
              type=click.Choice(list_profiles()), help="the device's profile (devices/profiles): its budget")
@click.option("--role", default="target", show_default=True, type=click.Choice(ROLES))
@click.option("--broker", "hub", required=True, help="the hub's broker as the DEVICE reaches it: mqtt(s)://HOST:PORT")
@click.option("--model", default=None, help="target/draft: a model name (edge.model.fetch) or file (.gguf, .onnx)")
@click.option("--bundle", default=None, help="target/draft: a bundle directory (edge-export bundle)")
@click.option("--module", default=None, help="prefill/decoder: a SUN module directory or its bundle")
@click.option("--backend", default="auto", show_default=True, type=click.Choice(["auto", "torch", "onnx", "llamacpp"]))
@click.option("--client-id", default=None, help="the agent's id at the hub (default: the device's host name)")
@click.option("--max-len", type=int, default=None, help="context per sequence (the plan's and the agent's)")
@click.option("--max-sessions", type=int, default=64, show_default=True, help="draft: sessions")
@click.option("--max-batch", type=int, default=64, show_default=True, help="decoder: rows per step")
@click.option("--memory-budget", default=None, metavar="SIZE", help="a budget instead of the profile's, e.g. 5G")
@click.option("--username", default=None, help="broker username (default with a password: the client id)")
@click.option("--password-file", default=None, help="file with the broker password the hub issued (copied, mode 600)")
@click.option("--tls-dir", default=None, help="mqtts://: `edge-hub certs` output; only ca.crt and this client's "
              "certificate and key are copied (never ca.key)")
@click.option("--ctl-key-file", default=None, help="the star's control key file (copied, mode 600)")
@click.option("--set", "extra", multiple=True, metavar="KEY=VALUE", help="another `edge-agent run` option for "
              "the config, e.g. --set http_port=8001 (repeatable)")
@click.option("--deps", default="pypi", show_default=True, type=click.Choice(["pypi", "device"]),
              help="pypi: install the kit's dependencies from the index (Jetson: JetPack's torch, "
                   "onnxruntime-gpu from --ort-index); device: the device's Python already has them (--no-deps)")
@click.option("--wheel", default=None, help="install this kit wheel instead of building one")
@click.option("--wheels", "wheels_dir", default=None, help="a directory of wheels for the device (--find-links)")
@click.option("--ort-index", default=None, help="index for onnxruntime-gpu (default on Jetson: "
              "https://pypi.jetson-ai-lab.io/jp6/cu126)")
@click.option("--device-python", default="python3", show_default=True, help="the device's interpreter (>= 3.10)")
@click.option("--ssh-config", default=None, help="an ssh config file (ssh -F): port, key, known hosts")
@click.option("--wait/--no-wait", default=True, show_default=True, help="wait until the agent has joined the hub "
              "(a target: and its OpenAI endpoint answers)")
@click.option("--timeout", default=180.0, show_default=True, help="seconds to wait for the join (and a target's "
              "OpenAI endpoint)")
@click.option("--watch-broker", "watch_hub", default=None, help="the hub's broker as this PC reaches it (default: --broker)")
@click.option("--watch-username", default=None, help="broker user for the PC's join watch (an ACL'd hub)")
@click.option("--watch-password-file", default=None, help="its password file")
@click.option("--watch-tls-dir", default=None, help="its TLS files (mqtts://)")
@click.option("--dry-run", is_flag=True, help="run the local checks and print every step; change nothing")
def main(device, profile_name, role, hub, model, bundle, module, backend, client_id, max_len, max_sessions,
         max_batch, memory_budget, username, password_file, tls_dir, ctl_key_file, extra, deps, wheel, wheels_dir,
         ort_index, device_python, ssh_config, wait, timeout, watch_hub, watch_username, watch_password_file,
         watch_tls_dir, dry_run):
    """Provision DEVICE over ssh as a ROLE of the star at HUB (idempotent; DRY=1 prints the steps)."""
    from edge.cli.broker_options import tls_files
    from edge.wire.link import LinkError, parse_url

    from devices.steps import Options, Provisioning
    try:
        parse_url(hub)
    except LinkError as e:
        raise click.BadParameter(str(e), param_hint="--broker") from None
    tls = tls_files(tls_dir, client_id or "CLIENT_ID", hub) if (tls_dir or hub.startswith("mqtts://")) else None
    if tls and not client_id:
        raise click.UsageError("with --tls-dir give --client-id (the certificate's CN)")
    o = Options(device, load_profile(profile_name), role, hub, model, bundle, module, backend, client_id, max_len,
                max_sessions, max_batch, memory_budget, username, password_file, tls, ctl_key_file,
                _extra_options(extra), deps, wheel, wheels_dir, ort_index, device_python, ssh_config, wait, timeout,
                _watch_credentials(watch_username, watch_password_file, watch_tls_dir, watch_hub or hub), watch_hub)
    p = Provisioning(o)
    if dry_run:
        return print_dry_run(p)
    p.remote.multiplex()
    try:
        run_steps(p, device, role, hub)
    finally:
        p.remote.close()


def run_steps(p, device: str, role: str, hub: str) -> None:
    """Each step in turn, with its progress; a failure names the step and how to resume."""
    from edge.wire.link import LinkError

    from devices.remote import RemoteError
    steps = p.steps()
    for i, (name, fn) in enumerate(steps, 1):
        t0 = time.monotonic()
        click.echo(f"[{i}/{len(steps)}] {name} ...")
        try:
            result = fn()
        except (click.ClickException, RemoteError, TimeoutError, LinkError, OSError, RuntimeError) as e:
            msg = e.format_message() if isinstance(e, click.ClickException) else str(e)
            where = ("nothing on the device was changed" if i <= 3 else
                     f"steps 1-{i - 1} are done; what they changed stays")
            raise click.ClickException(
                f"step {i}/{len(steps)} ({name}) failed: {msg}\n{where}. Fix it and run the same command again: "
                "each step compares hashes with the device and skips what is already there.") from None
        click.echo(f"      {result} ({time.monotonic() - t0:.1f} s)")
    if p.changed:
        click.echo(f"{device} is provisioned: {role} {p.client_id} -> {hub} (changed: {', '.join(p.changed)})")
    else:
        click.echo(f"nothing changed: {device} already runs this {role} (every hash matched)")


if __name__ == "__main__":
    main()
