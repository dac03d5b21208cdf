"""`edge-agent run --config FILE`: the run's options from a TOML file (what `make flash-jetson` writes).

    role = "draft"
    hub = "mqtt://hub.local:1883"
    client_id = "jetson1"
    model = "/home/nvidia/starsun/artifacts/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"
    backend = "llamacpp"
    profile = "jetson-orin-nano-8gb"
    password_file = "/home/nvidia/starsun/credentials/mqtt.password"

Keys are the long option names of `edge-agent run` (`--max-len` -> max_len or max-len); options
given on the command line override the file. The file never holds a secret: credentials stay
in their own files (password_file, tls_dir, ctl_key_file), so nothing secret is on a command line.
"""
from __future__ import annotations

import sys
from pathlib import Path

import click

if sys.version_info >= (3, 11):
    import tomllib
else:  # Jetson images ship Python 3.10
    import tomli as tomllib

SECRET_KEYS = {"password"}          # in the file it would sit next to the config anyone may read


def option_keys(command: click.Command) -> dict:
    """{config key: click parameter name} for every long option of `command`."""
    keys = {}
    for p in command.params:
        if not isinstance(p, click.Option) or not p.expose_value:
            continue
        for opt in p.opts:              # a flag pair's --no-x is the same key set to false
            if opt.startswith("--") and opt[2:].replace("-", "_") not in SECRET_KEYS:
                keys[opt[2:].replace("-", "_")] = p.name
    return keys


def read_config(path, command: click.Command) -> dict:
    """The file's values keyed by `command`'s parameter names (click's default_map); unknown keys
    and secrets are refused with the keys it knows."""
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except OSError as e:
        raise click.BadParameter(f"cannot read {path}: {e.strerror}", param_hint="--config") from None
    except tomllib.TOMLDecodeError as e:
        raise click.BadParameter(f"{path} is not valid TOML: {e}", param_hint="--config") from None
    keys = option_keys(command)
    out: dict = {}
    for key, value in data.items():
        k = key.replace("-", "_")
        if k in SECRET_KEYS:
            raise click.BadParameter(f"{path}: {key!r} would put a secret in the config file; "
                                     "use password_file (or $STARSUN_MQTT_PASSWORD) instead", param_hint="--config")
        if k not in keys:
            raise click.BadParameter(f"{path}: unknown key {key!r}; known: {', '.join(sorted(keys))}",
                                     param_hint="--config")
        out[keys[k]] = value
    return out


def _load(ctx: click.Context, _param, value):
    if value:   # defaults from the file; what the command line gives still wins
        ctx.default_map = {**(ctx.default_map or {}), **read_config(Path(value), ctx.command)}
    return value


config_option = click.option(
    "--config", type=click.Path(dir_okay=False), default=None, is_eager=True, expose_value=False,
    callback=_load, help="read these options from a TOML file (keys: the long option names, e.g. "
                         "role, hub, model, client_id); the command line overrides it")
