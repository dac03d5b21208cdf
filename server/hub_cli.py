"""`edge-hub`: the centre of the star. `serve` runs the hub (server/hub_serve.py); `certs` makes the
star's certificates; `top` shows every device's telemetry; `plan` is the StarSD system model
(server/planner.py); `demo` and `demo-sun` run the demos of server/demos/, imported only
inside those commands (the demos train with export/, which the hub itself never needs)."""
from __future__ import annotations

import logging

import click

from edge.cli.broker_options import (CLIENT_TLS_HELP, credential_options, ctl_key_option, hub_url_option, read_ctl_key,
                                     read_password, tls_dir_option, tls_files)
from edge.cli.options import renamed_option, verbose_option
from server.demos.commands import demo, demo_sun
from server.hub_serve import serve
from server.throughput_model import plan


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@verbose_option
def main():
    """StarSun hub: MQTT broker, registry and draft service for a star of devices."""


main.add_command(plan)
main.add_command(serve)                 # server/hub_serve.py; its --config: server/hub_config.py


@main.command()
@click.option("--out", required=True, type=click.Path(file_okay=False), help="directory of the star's certificates")
@click.option("--host", "hosts", multiple=True, metavar="NAME|ADDR",
              help="a name or address devices reach the hub by (repeatable; the broker's certificate)")
@renamed_option("--device", "--client-id CLIENT_ID (one per device, repeatable)")
@click.option("--client-id", "devices", multiple=True, metavar="CLIENT_ID",
              help="one client certificate per device / service (repeatable; CN = its client id)")
def certs(out, hosts, devices):
    """Make (or extend) the star's CA, the broker's certificate and one per device."""
    from server.certs import CertError, make_certs
    from edge.wire.protocol import ProtocolError
    try:
        written = make_certs(out, hosts or ("localhost", "127.0.0.1"), devices)
    except (CertError, ProtocolError) as e:
        raise click.ClickException(str(e)) from None
    for w in written:
        click.echo(f"wrote {w}", err=True)
    if not written:
        click.echo(f"{out}: every certificate asked for is already there", err=True)
    click.echo(f"copy ca.crt and clients/NAME.* to each device; keep ca.key here. Serve with "
               f"`edge-hub serve [--mosquitto] --acl --tls-dir {out} --listen ADDR --user CLIENT_ID ...`", err=True)


@main.command()
@hub_url_option()
@credential_options
@tls_dir_option(CLIENT_TLS_HELP)
@click.option("--client-id", default=None, help="certificate name for --tls-dir (default: --username, else top)")
@ctl_key_option
@click.option("--once", is_flag=True, help="print one snapshot and exit (scripts, tests)")
@click.option("--refresh", default=2.0, show_default=True, help="seconds between redraws")
@click.option("--wait", default=3.0, show_default=True,
              help="seconds to wait at most for the retained reports before the first table")
def top(hub_url, username, password, password_file, tls_dir, client_id, ctl_key_file, once, refresh, wait):
    """A live table of every device in the star, from its telemetry (ss/dev/+/telemetry).

    With the hub's ACL, --username is a user of role hub (`edge-hub serve --acl --user monitor:hub`)."""
    from edge.wire.link import LinkError, MqttLink
    from server.telemetry_board import TelemetryBoard
    from server.top import run_top

    password = read_password(password, password_file)
    tls = tls_files(tls_dir, client_id or username or "top", hub_url)
    try:
        link = MqttLink(hub_url, username=username, password=password, tls=tls).connect(10)
    except LinkError as e:
        raise click.ClickException(str(e)) from None
    board = TelemetryBoard(link, read_ctl_key(ctl_key_file)).start()
    try:
        run_top(board, once, refresh, wait)
    except KeyboardInterrupt:
        pass
    finally:
        link.close()


main.add_command(demo)
main.add_command(demo_sun)


if __name__ == "__main__":
    main()
