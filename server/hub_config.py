"""`edge-hub serve`'s configuration: its options read and checked into a HubConfig, from the command
line and from `--config hub.toml` (docs/examples/hub.toml), the command line overriding the file.

The file has one table per --help section of `edge-hub serve`, each key the long option's name:

    [broker]     broker, mosquitto, port, listen, tls_dir, insecure, acl, keepalive, user, credentials_out,
                 username, password_file, ctl_key_file
                 (broker: one URL or a list of a cluster's nodes; with an mqtts:// broker, tls_dir holds the
                 hub's own client certificate)
    [hub]        hub_id, hubs, stats_every
    [model]      dtype, threads, max_len, accelerator, gpu_layers, repack, exact_rows
    [draft]      draft_model, draft_backend, verify_model, verify_backend, client_share, max_sessions, max_kv_mb, max_gamma, evict_after, ahead,
                 coalesce, join, q_top_k, draft_p_min, drafter, suffix_min_score
    [sun]        sun_isolated, sun_pool, sun_decoder, sun_max_batch, sun_max_sequences, sun_backend,
                 stop_id, sun_http_port, sun_http_host, sun_tokenizer, sun_request_timeout,
                 sun_grammars_on_demand
    [telemetry]  telemetry_interval, metrics_port, metrics_host

Secrets stay out of it (edge/cli/config_file.py refuses `password` and `ctl_key`; a `user` entry
with a password is refused here): the hub writes the passwords it makes to credentials_out.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional

import click

from edge.cli.config_file import config_option, read_sectioned_config
from edge.cli.broker_options import KEEPALIVE_S, read_ctl_key, read_password
from edge.cli.options import draft_limits
from edge.cli.startup import DraftSetup, TelemetrySettings


@dataclass
class BrokerUser:
    """A --user NAME[:ROLE[:PASSWORD]]: a client, a draft service (draft), a SUN worker (sun), a monitor (hub)."""
    name: str
    role: str = "client"
    password: Optional[str] = None      # None: the broker makes one (written to --credentials-out)

    @classmethod
    def parse(cls, spec: str) -> "BrokerUser":
        name, role, password = (spec.split(":") + ["", ""])[:3]
        return cls(name, role or "client", password or None)


@dataclass
class BrokerSettings:
    """The hub's broker: an external one (url) or one started here, its listeners and users."""
    url: Optional[str]                  # --broker; None: start one here
    kind: str                           # embedded | mosquitto
    port: int
    listeners: list                     # server.broker_base.Listener beyond loopback
    acl: bool
    users: List[BrokerUser]
    credentials_out: Optional[str]      # where the users' passwords are written (mode 600)
    username: Optional[str]             # the hub's own user on an external broker
    password: Optional[str]
    tls: Optional[tuple] = None         # (CA, certificate, key): the hub's own on an external mqtts:// broker
    keepalive: int = KEEPALIVE_S        # --keepalive: every link of the hub


@dataclass
class SunSettings:
    """SUN routing, the decoder the hub may host, and its OpenAI endpoint."""
    isolated: bool
    pools: dict                         # {task: [decoder ids]} with isolated
    decoder_dir: Optional[str]
    max_batch: int
    max_sequences: int
    backend: str
    stop_ids: tuple
    http_port: int
    http_host: str
    tokenizer: Optional[str]            # the SUN base model whose tokenizer the endpoint uses
    request_timeout: float = 300.0      # the endpoint's limit on one request, queueing included
    grammars_on_demand: bool = False    # the endpoint's grammar tokenizer at the first grammar, not at start


@dataclass
class HubConfig:
    """Everything `edge-hub serve` was told, read and checked: what server/hub_cli.py starts."""
    hub_id: str
    stats_every: float
    ctl_key: Optional[bytes]
    broker: BrokerSettings
    dtype: str
    threads: Optional[int]
    max_len: int
    draft: Optional[DraftSetup]          # the hub's own draft service, or None (devices draft)
    client_share: float
    sun: SunSettings
    telemetry: TelemetrySettings = field(default_factory=TelemetrySettings)
    device: str = "auto"                # where the draft and the SUN decoder run (--accelerator)
    gpu_layers: Optional[str] = None    # llama.cpp: N | all (--gpu-layers)
    draft_backend: str = "auto"         # the hub draft's engine (--draft-backend; auto: edge/model/resolved.py)
    hubs: tuple = ()                    # every hub's id when there are several (--hub-ids)
    verify_model: Optional[str] = None  # the reverse star's target (--verify-model), or None
    verify_backend: str = "auto"        # its engine (--verify-backend)
    verify_limits: object = None        # its sessions, KV, γ and eviction: the draft options' (DraftLimits)
    repack: str = "auto"                # llama.cpp's CPU weight repacking of every model it loads (--repack)
    exact_rows: bool = False            # the verify target's exact rows (--exact-rows; llamacpp_rows.py)


def hub_config_from(o: dict) -> HubConfig:
    """`serve`'s options (by parameter name) checked and read into a HubConfig."""
    if o["hubs"] and o["hub_id"] not in o["hubs"]:
        raise click.BadParameter(f"--hub-id {o['hub_id']} is not in --hub-ids {','.join(o['hubs'])}: give every hub's "
                                 "id, this one's included, in the same list on every hub and target",
                                 param_hint="--hub-ids")
    broker = broker_settings(o)
    ctl_key = read_ctl_key(o["ctl_key_file"])
    sun = _sun_settings(o)
    return HubConfig(o["hub_id"], o["stats_every"], ctl_key, broker, o["dtype"], o["threads"], o["max_len"],
                     _draft_plan(o), o["client_share"], sun, TelemetrySettings.from_options(o),
                     o["device"], o["gpu_layers"], o["draft_backend"], o["hubs"],
                     o.get("verify_model"), o.get("verify_backend", "auto"), _verify_limits(o),
                     o.get("repack", "auto"), bool(o.get("exact_rows")))


def _verify_limits(o: dict):
    """The verify service's limits: the draft options' (sessions, KV, γ, eviction), nothing drafted ahead."""
    from dataclasses import replace
    return replace(draft_limits(o), ahead=False) if o.get("verify_model") else None


def broker_settings(o: dict) -> BrokerSettings:
    from server.listen import listeners_for

    password = read_password(o["password"], o["password_file"])
    url, users = o["broker_url"], [BrokerUser.parse(u) for u in o["users"]]
    if url and o["listen"]:
        raise click.UsageError("--listen configures a broker started here; not with --broker (the external "
                               "broker's own listeners serve the devices)")
    tls = external_broker_tls(url, o["tls_dir"], o["username"] or o["hub_id"]) if url else None
    try:
        listeners = listeners_for(o["listen"], None if url else o["tls_dir"], o["insecure"], o["acl"])
    except ValueError as e:
        raise click.UsageError(str(e)) from None
    if url and (o["mosquitto"] or o["acl"] or users or o["credentials_out"]):
        raise click.UsageError("--mosquitto, --acl, --user and --credentials-out configure a broker started here; "
                               "they do not apply with --broker")
    if users and not o["acl"]:
        raise click.UsageError("--user needs --acl (without an ACL anyone may connect)")
    unset = [u.name for u in users if u.password is None]
    if unset and not o["credentials_out"]:
        raise click.UsageError(f"--user {unset[0]} has no password: the hub makes one, and writes it only to a file "
                               "of yours. Add --credentials-out FILE (written mode 600; give each device its line's "
                               "password as --password-file), or give NAME:ROLE:PASSWORD")
    return BrokerSettings(url, "mosquitto" if o["mosquitto"] else "embedded", o["port"], listeners, o["acl"], users,
                          o["credentials_out"], o["username"], password, tls, o.get("keepalive") or KEEPALIVE_S)


def external_broker_tls(url: str, tls_dir: Optional[str], cert_name: str) -> Optional[tuple]:
    """--broker mqtts://A[,mqtts://B...] --tls-dir DIR: the hub is a client of that broker, with the CA
    that verifies it and the hub's certificate (CN = --username, else --hub-id); mqtt:// takes none."""
    from edge.cli.broker_options import tls_files
    from edge.wire.link import LinkError, parse_urls
    try:
        urls = parse_urls(url)
    except LinkError as e:
        raise click.BadParameter(str(e), param_hint="--broker") from None
    if not urls[0].startswith("mqtts://"):
        if tls_dir:
            raise click.UsageError(f"--tls-dir {tls_dir} with --broker {url}: TLS files need an mqtts:// broker "
                                   "list (write --broker mqtts://HOST:PORT[,...]), or drop --tls-dir")
        return None
    if not tls_dir:
        raise click.UsageError(f"--broker {url} speaks TLS: add --tls-dir DIR holding ca.crt and the hub's "
                               f"{cert_name}.crt / {cert_name}.key (CN = {cert_name}: --username, else --hub-id)")
    return tls_files(tls_dir, cert_name, urls[0])


def _draft_plan(o: dict) -> Optional[DraftSetup]:
    if not o["draft_model"]:
        if o["drafter"] != "model":
            raise click.UsageError(f"--drafter {o['drafter']} needs --draft-model (for suffix: only its tokenizer "
                                   "is loaded, to serve the targets that share it)")
        return None
    return DraftSetup(o["drafter"], o["draft_model"], draft_limits(o), o["suffix_min_score"])


def _sun_settings(o: dict) -> SunSettings:
    pools = parse_pools(o["sun_pools"])
    if pools and not o["sun_isolated"]:
        raise click.UsageError("--sun-pool gives a task its own decoders: it needs --sun-isolated")
    if o["sun_http_port"] and not o["sun_tokenizer"]:
        raise click.UsageError("--sun-http-port needs --sun-tokenizer (the SUN base model, e.g. smollm2-135m)")
    return SunSettings(o["sun_isolated"], pools, o["sun_decoder"], o["sun_max_batch"], o["sun_max_sequences"],
                       o["sun_backend"], o["stop_ids"], o["sun_http_port"], o["sun_http_host"], o["sun_tokenizer"],
                       o.get("sun_request_timeout", 300.0), bool(o.get("sun_grammars_on_demand")))


def parse_pools(specs) -> dict:
    """('maths=dec-a,dec-b', ...) -> {'maths': ['dec-a', 'dec-b']}."""
    pools: dict = {}
    for spec in specs:
        task, _, decs = spec.partition("=")
        names = [d.strip() for d in decs.split(",") if d.strip()]
        if not task.strip() or not names:
            raise click.BadParameter(f"{spec!r}: write TASK=DECODER[,DECODER...]", param_hint="--sun-pool")
        pools.setdefault(task.strip(), []).extend(names)
    return pools


def _no_password_in_users(path, where: str, key: str, value) -> None:
    """A `user` entry of the file must not carry a password: the file is no place for secrets."""
    if key == "user":
        for spec in value if isinstance(value, list) else [value]:
            if isinstance(spec, str) and BrokerUser.parse(spec).password is not None:
                name = spec.split(":")[0]
                raise click.BadParameter(f"{path}: {where}user {name!r} carries a password, a secret in the config "
                                         "file; list NAME[:ROLE] only and set credentials_out (the hub writes the "
                                         "passwords it makes there)", param_hint="--config")


def read_hub_config(path, command: click.Command) -> dict:
    """hub.toml's values keyed by `serve`'s parameter names (its default_map)."""
    return read_sectioned_config(path, command, check=_no_password_in_users)


hub_config_option = config_option(
    read_hub_config, help="read these options from a TOML file: a table per --help section ([broker], [hub], "
                          "[model], [draft], [sun], [telemetry]), keys the long option names (docs/examples/"
                          "hub.toml); the command line overrides it")
