"""`--config FILE`: a command's options from a TOML file, the command line overriding it.

Keys are the long option names (`--max-len` -> max_len or max-len; a flag pair takes its first
name: `ahead = false`). Two layouts:

* flat (`edge-agent run --config`, what `make flash-jetson` writes): every key at the top;
* sectioned (`edge-hub serve --config`): each key in the table of its --help section
  (edge/cli/sections.py: [broker], [hub], [model], [draft], [sun], [telemetry]).

The file's values become the command's defaults (click's default_map), so whatever the command
line gives wins. A file never holds a secret: a password or a key is refused with the option
that reads it from its own file instead; an unknown key is refused with the keys known.
"""
from __future__ import annotations

import sys
from typing import Callable

import click

from edge.cli.sections import section_of

if sys.version_info >= (3, 11):
    import tomllib
else:  # Jetson images ship Python 3.10
    import tomli as tomllib

# a secret in the file would sit next to a config anyone may read: {key: what to use instead}
SECRET_KEYS = {"password": "password_file (or $STARSUN_MQTT_PASSWORD)", "ctl_key": "ctl_key_file"}
# keys of options that were renamed (edge/cli/options.py, renamed_option): {old key: the key now}
RENAMED_KEYS = {"hub": "broker", "hubs": "hub_ids", "device": "accelerator"}


def _check_renamed(path, where: str, key: str, known) -> None:
    if _key(key) in RENAMED_KEYS and _key(key) not in known:
        _refuse(path, where, f"{key!r} is gone: write {RENAMED_KEYS[_key(key)]} = ... instead")


def _key(name: str) -> str:
    return name.replace("-", "_")


def option_keys(command: click.Command) -> dict:
    """{config key: click parameter} for every long option of `command` (secrets left out)."""
    keys = {}
    for p in command.params:
        if not isinstance(p, click.Option) or not p.expose_value:
            continue
        for opt in p.opts:
            if opt.startswith("--") and _key(opt[2:]) not in SECRET_KEYS:
                keys[_key(opt[2:])] = p
    return keys


def _value(param: click.Parameter, value):
    """A TOML list for a one-string option (a broker list: hub = ["mqtts://a", "mqtts://b"])
    becomes the command line's comma-separated form."""
    if isinstance(value, list) and not param.multiple and isinstance(param.type, click.types.StringParamType):
        return ",".join(str(v) for v in value)
    return value


def _load_toml(path) -> dict:
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except OSError as e:
        raise click.BadParameter(f"cannot read {path}: {e.strerror}", param_hint="--config") from None
    except tomllib.TOMLDecodeError as e:
        raise click.BadParameter(f"{path} is not valid TOML: {e}", param_hint="--config") from None


def _refuse(path, where: str, message: str):
    raise click.BadParameter(f"{path}: {where}{message}", param_hint="--config")


def _check_secret(path, where: str, key: str) -> None:
    if _key(key) in SECRET_KEYS:
        _refuse(path, where, f"{key!r} would put a secret in the config file; use {SECRET_KEYS[_key(key)]} instead")


def read_config(path, command: click.Command) -> dict:
    """A flat file's values keyed by `command`'s parameter names (click's default_map)."""
    keys = option_keys(command)
    out: dict = {}
    for key, value in _load_toml(path).items():
        _check_secret(path, "", key)
        _check_renamed(path, "", key, keys)
        if _key(key) not in keys:
            _refuse(path, "", f"unknown key {key!r}; known: {', '.join(sorted(keys))}")
        out[keys[_key(key)].name] = _value(keys[_key(key)], value)
    return out


def read_sectioned_config(path, command: click.Command, check: Callable = None) -> dict:
    """A sectioned file's values keyed by `command`'s parameter names; a key must sit in its
    option's table. check(path, where, key, value) may refuse a value (e.g. a password inside a list)."""
    keys = option_keys(command)
    tables = {}
    for k, p in keys.items():
        if section_of(p) is not None:
            tables.setdefault(section_of(p).table, {})[k] = p
    out: dict = {}
    known = ", ".join(f"[{t}]" for t in tables)
    for table, values in _load_toml(path).items():
        if not isinstance(values, dict):
            _check_secret(path, "", table)
            _refuse(path, "", f"{table!r} outside a table: write each key in its section's table ({known})")
        if table not in tables:
            _refuse(path, "", f"unknown table [{table}]; known: {known}")
        for key, value in values.items():
            where = f"[{table}] "
            _check_secret(path, where, key)
            _check_renamed(path, where, key, tables[table])
            if _key(key) not in tables[table]:
                home = next((f"; it belongs in [{t}]" for t, ks in tables.items() if _key(key) in ks), "")
                _refuse(path, where, f"unknown key {key!r}{home or '; known here: ' + ', '.join(tables[table])}")
            if check is not None:
                check(path, where, _key(key), value)
            out[tables[table][_key(key)].name] = _value(tables[table][_key(key)], value)
    return out


def config_option(reader: Callable, help: str):
    """--config FILE read by `reader(path, command)` into the command's defaults."""
    def load(ctx: click.Context, _param, value):
        if value:   # defaults from the file; what the command line gives still wins
            ctx.default_map = {**(ctx.default_map or {}), **reader(value, ctx.command)}
        return value
    return click.option("--config", type=click.Path(dir_okay=False), default=None, is_eager=True,
                        expose_value=False, callback=load, help=help)
