"""Command-line pieces `edge-agent` and `edge-hub` share: the draft service's limits, the
control key, and opening a model with errors a user can act on.

They live here, not in a command module, so that each CLI imports only this
file and no CLI imports another (the hub never imports the agent's commands).
"""
from __future__ import annotations

import time

import click

_draft_opts = [
    click.option("--max-sessions", default=64, show_default=True, help="sessions one draft service takes"),
    click.option("--max-kv-mb", default=1024.0, show_default=True, help="KV memory of all sessions"),
    click.option("--max-gamma", default=16, show_default=True, help="largest γ a session may ask for"),
    click.option("--evict-after", default=60.0, show_default=True, help="seconds of silence before eviction"),
    click.option("--ahead/--no-ahead", default=True, show_default=True,
                 help="draft ahead for recently served sessions while idle"),
    click.option("--q-top-k", default=32, show_default=True,
                 help="entries of q sent per drafted token when sampling"),
]


def draft_options(f):
    """The draft service's limits (`edge-agent run` and `edge-hub serve`)."""
    for opt in reversed(_draft_opts):
        f = opt(f)
    return f


def draft_limits(max_sessions, max_kv_mb, max_gamma, evict_after, ahead, q_top_k):
    from edge.roles.draft import DraftLimits
    return DraftLimits(max_sessions=max_sessions, max_kv_mb=max_kv_mb, max_gamma=max_gamma,
                       evict_after_s=evict_after, ahead=ahead, q_top_k=q_top_k)


def read_ctl_key(path):
    """The deployment's control key (hub <-> draft services and SUN workers sign their control
    messages with it): the bytes of a file, at least 16; None without --ctl-key-file."""
    if not path:
        return None
    from pathlib import Path
    try:
        key = Path(path).read_bytes().strip()
    except OSError as e:
        raise click.BadParameter(f"cannot read {path}: {e.strerror}", param_hint="--ctl-key-file") from None
    if len(key) < 16:
        raise click.BadParameter(f"{path} holds {len(key)} bytes; a control key needs at least 16 "
                                 "(e.g. `head -c 32 /dev/urandom | base64 > ctl.key`)",
                                 param_hint="--ctl-key-file")
    return key


ctl_key_option = click.option("--ctl-key-file", default=None, type=click.Path(dir_okay=False),
                              help="sign control messages with this shared key (the same file on the hub "
                                   "and every draft service / SUN worker)")


def open_model_for_command(spec: str, dtype: str, threads, max_len: int, backend: str = "torch",
                           role=None, **engine_kw):
    """edge.engines.loader.open_model, its errors shown as click errors and the load time reported;
    engine_kw go to the engine (what the memory plan counted, e.g. llama.cpp's n_seq_max)."""
    from edge.checkpoint_files import CheckpointError   # torch-free: llama.cpp / ORT roles skip torch
    from edge.engines.base import EngineError       # ModelNotFound is one
    from edge.engines.loader import open_model
    from edge.model_spec import resolve_model

    t0 = time.perf_counter()
    try:
        engine, tok = open_model(spec, backend=backend, role=role, dtype=dtype, threads=threads, max_len=max_len,
                                 **engine_kw)
    except (CheckpointError, EngineError) as e:
        raise click.ClickException(str(e)) from None
    click.echo(f"loaded {resolve_model(spec).name} on {engine.name} (vocab {engine.vocab_size}) "
               f"in {time.perf_counter() - t0:.1f}s", err=True)
    return engine, tok


PASSWORD_ENV = "STARSUN_MQTT_PASSWORD"


def read_password(password, path):
    """A broker password from --password-file or $STARSUN_MQTT_PASSWORD (a --password on the
    command line still works, with a warning: anyone on the machine can read it in `ps`)."""
    import os
    if password and path:
        raise click.UsageError("give --password or --password-file, not both")
    if path:
        from pathlib import Path
        try:
            return Path(path).read_text().strip() or None
        except OSError as e:
            raise click.BadParameter(f"cannot read {path}: {e.strerror}", param_hint="--password-file") from None
    if password:
        click.echo("warning: a password on the command line is visible to every user in `ps`; "
                   f"use --password-file or ${PASSWORD_ENV}", err=True)
        return password
    return os.environ.get(PASSWORD_ENV) or None


def tls_files(tls_dir, client_id: str, hub_url: str):
    """(CA, certificate, key) for an mqtts:// hub from --tls-dir, or None for mqtt://."""
    from pathlib import Path
    if not hub_url.startswith("mqtts://"):
        if tls_dir:
            raise click.UsageError("--tls-dir needs an mqtts://HOST:PORT --hub")
        return None
    if not tls_dir:
        raise click.UsageError("an mqtts:// --hub needs --tls-dir DIR (ca.crt and this client's "
                               "certificate and key, from `edge-hub certs --device CLIENT_ID`)")
    d = Path(tls_dir)
    for base in (d / "clients", d):
        cert, key = base / f"{client_id}.crt", base / f"{client_id}.key"
        if cert.is_file() and key.is_file() and (d / "ca.crt").is_file():
            return str(d / "ca.crt"), str(cert), str(key)
    raise click.UsageError(f"--tls-dir {tls_dir}: need ca.crt and {client_id}.crt / {client_id}.key "
                           f"(the certificate's CN must be the client id {client_id!r}); make them on the hub "
                           f"with `edge-hub certs --out DIR --device {client_id}`")
