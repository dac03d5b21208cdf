"""The options that say how a process reaches the star's broker (`edge-agent`, `edge-hub`), declared
once, and their readers: --broker, --keepalive, --username / --password(-file), --tls-dir,
--ctl-key-file; a password, TLS files, the control key read with errors that say what to do."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import click

from edge.cli.options import apply, renamed_option
from edge.cli.sections import BROKER, option

PASSWORD_ENV = "STARSUN_MQTT_PASSWORD"


def hub_url_option(required: bool = True):
    """--broker: the star's MQTT broker (`edge-agent run`, `edge-hub top`)."""
    real = option(BROKER, "--broker", "hub_url", required=required, metavar="mqtt[s]://HOST:PORT[,...]",
                  help="the star's MQTT broker (the hub's); several nodes of a clustered broker comma-separated "
                       "(a list in a config file): on losing one, the link moves to the next")
    return lambda f: renamed_option("--hub", "--broker mqtt[s]://HOST:PORT")(real(f))


KEEPALIVE_S = 15            # MQTT keepalive: paho gives a silent broker up after ~1.5-2x this


keepalive_option = option(BROKER, "--keepalive", default=KEEPALIVE_S, show_default=True, metavar="S",
                          type=click.IntRange(2, 3600),
                          help="MQTT keepalive in seconds: a broker node that goes silent (a partition, a hung "
                               "node) is given up, and the next one of the list tried, after about 1.5-2x this; "
                               "shorter fails over sooner at one PINGREQ/PINGRESP pair per S of idle link")


def tls_dir_option(help: str):
    return option(BROKER, "--tls-dir", default=None, type=click.Path(file_okay=False), help=help)


CLIENT_TLS_HELP = ("with an mqtts:// --broker: ca.crt and this client's CLIENT_ID.crt/.key (or clients/CLIENT_ID.*), "
                   "from `edge-hub certs`")


def credential_options(f):
    """--username / --password / --password-file: who this process is on the broker."""
    return apply(f, [
        option(BROKER, "--username", default=None,
               help="broker username (with the hub's ACL: the client id; edge-hub serve: its user on an "
                    "external --broker)"),
        option(BROKER, "--password", default=None,
               help=f"broker password (visible in ps: prefer --password-file or ${PASSWORD_ENV})"),
        option(BROKER, "--password-file", default=None, type=click.Path(dir_okay=False),
               help="file holding the broker password (the hub issued it: --credentials-out)"),
    ])


ctl_key_option = option(BROKER, "--ctl-key-file", default=None, type=click.Path(dir_okay=False),
                        help="sign control messages with this shared key (the same file on the hub and every "
                             "draft service / SUN worker)")


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
            raise click.UsageError("--tls-dir needs an mqtts://HOST:PORT --broker")
        return None
    if not tls_dir:
        raise click.UsageError("an mqtts:// --broker needs --tls-dir DIR (ca.crt and this client's "
                               "certificate and key, from `edge-hub certs --client-id CLIENT_ID`)")
    d = Path(tls_dir)
    for base in (d / "clients", d):
        cert, key = base / f"{client_id}.crt", base / f"{client_id}.key"
        if cert.is_file() and key.is_file() and (d / "ca.crt").is_file():
            return str(d / "ca.crt"), str(cert), str(key)
    raise click.UsageError(f"--tls-dir {tls_dir}: need ca.crt and {client_id}.crt / {client_id}.key "
                           f"(the certificate's CN must be the client id {client_id!r}); make them on the hub "
                           f"with `edge-hub certs --out DIR --client-id {client_id}`")


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


@dataclass
class BrokerAccess:
    """How a process reaches the star's broker: its URL, credentials and TLS files."""
    url: str
    username: Optional[str] = None
    password: Optional[str] = None
    tls: Optional[tuple] = None           # (CA, certificate, key) for mqtts://
    keepalive: int = KEEPALIVE_S          # --keepalive

    def link(self, **kw):
        from edge.wire.link import MqttLink
        kw.setdefault("keepalive", self.keepalive)
        return MqttLink(self.url, username=self.username, password=self.password, tls=self.tls, **kw)


def broker_access(options: dict, tls_name: str) -> BrokerAccess:
    """--broker, --username, --password(-file), --tls-dir and --keepalive read (TLS files named for `tls_name`)."""
    return BrokerAccess(options["hub_url"], options["username"],
                        read_password(options["password"], options["password_file"]),
                        tls_files(options["tls_dir"], tls_name, options["hub_url"]),
                        options.get("keepalive") or KEEPALIVE_S)
