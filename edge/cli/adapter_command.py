"""`edge-agent add-adapter WORKER TASK PATH`: load one more adapter into a running prefill worker.

Sends the signed AdapterAdd (edge/sun/adapter_control.py) and prints the worker's answer; exits 1
when the adapter is refused (the reason is printed) or no answer comes. The sha256 the worker
checks is --sha256, or computed here from PATH when this machine sees the same file: a PEFT
directory's adapter_model.safetensors, a GGUF file itself, or with --bundle the digest the
bundle's manifest lists for TASK's GGUF.
"""
from __future__ import annotations

import hashlib
import json
import socket
from pathlib import Path
from typing import Optional

import click

from edge.cli.broker_options import (broker_access, CLIENT_TLS_HELP, credential_options, ctl_key_option, hub_url_option,
                                     read_ctl_key, tls_dir_option)
from edge.cli.sections import SUN, SectionedCommand, option


def local_sha256(path: str, task: str, bundle: bool) -> str:
    """The digest the worker will check, from the file as this machine sees it."""
    p = Path(path)
    if bundle:
        try:
            entries = json.loads((p / "manifest.json").read_text()).get("adapters") or []
        except (OSError, ValueError) as e:
            raise click.BadParameter(f"cannot read {p / 'manifest.json'}: {e}; pass --sha256") from None
        entry = next((a for a in entries if isinstance(a, dict) and a.get("task") == task), None)
        if entry is None:
            raise click.BadParameter(f"{p} lists no adapter for task {task!r}")
        return entry["files"][0]["sha256"]
    target = p / "adapter_model.safetensors" if p.is_dir() else p
    if not target.is_file():
        raise click.BadParameter(f"{target} is not here: pass --sha256 (the worker reads PATH on its own machine)")
    h = hashlib.sha256()
    with open(target, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


@click.command(cls=SectionedCommand)
@click.argument("worker")
@click.argument("task")
@click.argument("path")
@option(SUN, "--sha256", default=None, help="the digest the worker checks (default: computed here from PATH)")
@option(SUN, "--bundle", is_flag=True, help="PATH is a bundle; load its manifest's adapter for TASK")
@option(SUN, "--timeout", default=60.0, show_default=True, help="seconds to wait for the worker's answer")
@option(SUN, "--client-id", default=None, help="this tool's id on the star (default: HOST-adapter)")
@hub_url_option()
@credential_options
@tls_dir_option(CLIENT_TLS_HELP)
@ctl_key_option
def add_adapter(worker, task, path, sha256: Optional[str], bundle, timeout, client_id, **o):
    """Load TASK's adapter from PATH (on the worker's machine) into the running prefill WORKER."""
    from edge.sun.adapter_control import AdapterAddTimeout, add_adapter as send, result_text
    from edge.wire.link import LinkError
    from edge.wire.protocol import ProtocolError, check_id

    key = read_ctl_key(o["ctl_key_file"])
    if key is None:
        raise click.UsageError("--ctl-key-file is required: a worker loads adapters only on signed control messages")
    client_id = client_id or f"{socket.gethostname().split('.')[0]}-adapter"
    try:
        for value, what in ((worker, "WORKER"), (task, "TASK"), (client_id, "--client-id")):
            check_id(value, what)
    except ProtocolError as e:
        raise click.BadParameter(str(e)) from None
    digest = sha256 or local_sha256(path, task, bundle)
    link = broker_access(o, client_id).link(client_id=client_id)
    try:
        link.connect(timeout=10)
        r = send(link, worker, task, path, digest, key, client=client_id, bundle=bundle, timeout=timeout)
    except (LinkError, AdapterAddTimeout) as e:
        raise click.ClickException(str(e)) from None
    finally:
        link.close()
    click.echo(result_text(r))
    if not r.ok:
        raise SystemExit(1)
