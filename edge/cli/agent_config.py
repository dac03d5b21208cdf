"""`edge-agent run --config FILE`: the run's options from a flat TOML file (what `make flash-jetson`
writes; the reader is edge/cli/config_file.py's).

    role = "draft"
    broker = "mqtt://hub.local:1883"
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

from edge.cli.config_file import SECRET_KEYS, config_option as _config_option, read_config

__all__ = ["SECRET_KEYS", "config_option", "read_config"]

config_option = _config_option(read_config, help="read these options from a TOML file (keys: the long option "
                                                 "names, e.g. role, broker, model, client_id); the command line "
                                                 "overrides it")
