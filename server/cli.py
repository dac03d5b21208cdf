"""`edge-hub`: the centre of the star. `serve` runs the hub; `plan` (the StarSD
system model, server/planner.py) is registered at the bottom of this file."""
from __future__ import annotations

import logging
import signal
import threading
import time

import click


from edge.agent_run import draft_limits, draft_options


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("-v", "--verbose", count=True, help="-v info, -vv debug logging")
def main(verbose):
    """StarSun hub: MQTT broker, registry and draft service for a star of devices."""
    logging.basicConfig(level=[logging.WARNING, logging.INFO, logging.DEBUG][min(verbose, 2)],
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")


@main.command()
@click.option("--broker", "broker_url", default=None, metavar="mqtt://HOST:PORT",
              help="use this MQTT broker (default: start one here)")
@click.option("--mosquitto", is_flag=True, help="start Mosquitto instead of the embedded amqtt broker")
@click.option("--port", default=1883, show_default=True, help="port of the broker started here")
@click.option("--acl", is_flag=True,
              help="broker started here: passwords + ACL (clients connect with username = client id)")
@click.option("--user", "users", multiple=True, metavar="NAME[:ROLE[:PASSWORD]]",
              help="with --acl: register a client (role client), a draft service (role draft) "
                   "or a SUN worker (role sun)")
@click.option("--username", default=None, help="hub's username on an external --broker")
@click.option("--password", default=None, help="hub's password on an external --broker")
@click.option("--draft-model", default=None, help="model name or path of the hub's own draft service")
@click.option("--hub-id", default="hub", show_default=True)
@click.option("--dtype", default="float32", type=click.Choice(["float32", "float64", "bfloat16"]),
              show_default=True)
@click.option("--threads", default=None, type=int, help="torch threads (default: all cores)")
@click.option("--max-len", default=4096, show_default=True, help="context cap per session")
@click.option("--stats-every", default=5.0, show_default=True, help="seconds between stats lines (0: off)")
@click.option("--sun-isolated", is_flag=True,
              help="SUN: one decoder pool per task (the conventional baseline) instead of one shared pool")
@click.option("--sun-pool", "sun_pools", multiple=True, metavar="TASK=DEC1,DEC2",
              help="with --sun-isolated: the decoders that serve TASK "
                   "(repeatable; default: each task binds one free decoder)")
@click.option("--sun-decoder", default=None, metavar="DIR",
              help="SUN: also run this shared decoder (export.tune.save_decoder dir) inside the hub")
@click.option("--sun-max-batch", default=64, show_default=True, help="--sun-decoder: sequences per step")
@click.option("--stop-id", "stop_ids", multiple=True, type=int,
              help="--sun-decoder: extra end-of-sequence token ids (repeatable)")
@draft_options
def serve(broker_url, mosquitto, port, acl, users, username, password, draft_model, hub_id, dtype,
          threads, max_len, stats_every, sun_isolated, sun_pools, sun_decoder, sun_max_batch, stop_ids,
          **limits):
    """Run the hub until Ctrl-C."""
    from server.broker import BrokerError
    from server.hub import Hub

    if broker_url and (mosquitto or acl or users):
        raise click.UsageError("--mosquitto, --acl and --user configure a broker started here; "
                               "they do not apply with --broker")
    if users and not acl:
        raise click.UsageError("--user needs --acl (without an ACL anyone may connect)")
    pools = _parse_pools(sun_pools)
    if pools and not sun_isolated:
        raise click.UsageError("--sun-pool gives a task its own decoders: it needs --sun-isolated")
    decoder = None
    if sun_decoder:
        from edge.roles.decoder import SharedDecoder
        from edge.sun import SunError
        try:
            decoder = SharedDecoder.from_dir(sun_decoder, threads=threads, max_batch=sun_max_batch,
                                             stop_ids=stop_ids, name=f"{hub_id}-decoder")
        except (SunError, OSError) as e:
            raise click.ClickException(f"--sun-decoder {sun_decoder}: {e}") from None
    engine = tok_fp = None
    if draft_model:
        from edge.cli import load_engine
        engine, tok = load_engine(draft_model, dtype, threads, max_len)
        tok_fp = tok.fingerprint()
    else:
        click.echo("no --draft-model: this hub only routes to draft services on devices "
                   "(`edge-agent run --role draft`)", err=True)
    hub = Hub(broker_url=broker_url, broker="mosquitto" if mosquitto else "embedded", port=port, acl=acl,
              draft_engine=engine, tokenizer_fp=tok_fp or "", limits=draft_limits(**limits), hub_id=hub_id,
              username=username, password=password, sun_isolated=sun_isolated, sun_pools=pools,
              sun_decoder=decoder)
    try:
        hub.start()
    except BrokerError as e:
        raise click.ClickException(str(e)) from None
    except Exception as e:  # LinkError and friends carry a message that says what to do
        raise click.ClickException(f"the hub could not start: {e}") from None
    for spec in users:
        name, role, pw = (spec.split(":") + ["", ""])[:3]
        pw = hub.broker.add_user(name, role or "client", pw or None)
        click.echo(f"user {name} ({role or 'client'}): password {pw}", err=True)
    click.echo(f"hub {hub_id} serving on {hub.url}" + (f" with draft {draft_model}" if draft_model else "")
               + (f" and SUN decoder {hub.sun_node.id}" if hub.sun_node else ""), err=True)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        while not stop.wait(stats_every or 3600):
            if stats_every:
                click.echo(_stats_line(hub), err=True)
    finally:
        hub.stop()


def _parse_pools(specs) -> dict:
    """('maths=dec-a,dec-b', ...) -> {'maths': ['dec-a', 'dec-b']}."""
    pools: dict = {}
    for spec in specs:
        task, _, decs = spec.partition("=")
        names = [d.strip() for d in decs.split(",") if d.strip()]
        if not task.strip() or not names:
            raise click.BadParameter(f"{spec!r}: write TASK=DECODER[,DECODER...]", param_hint="--sun-pool")
        pools.setdefault(task.strip(), []).extend(names)
    return pools


def _stats_line(hub) -> str:
    s = hub.snapshot()
    c = s["counters"]
    line = (f"{time.strftime('%H:%M:%S')} sessions={s['registry']['sessions']} joins={c['joins']} "
            f"refused={c['refused']}")
    d = s.get("draft")
    if d:
        line += (f" requests={d['requests']} busy={d['busy_ratio']:.2f} batch={d['batch_size_mean']:.1f}"
                 f" t_idle={1e3 * d['t_idle_mean_s']:.1f}ms dropped={sum(s['dropped'].values())}")
    sun = s.get("sun")
    if sun and (sun["workers"] or sun["counters"]["requests"]):
        online = sum(w["online"] for w in sun["workers"].values())
        line += f" sun_workers={online} sun_routed={sun['counters']['routed']}"
    return line


# `edge-hub plan`: the StarSD system model (server/planner.py) exposes a click
# command named `plan`; it is added here when present.
try:
    from server.planner import plan as _plan  # noqa: E402

    main.add_command(_plan, "plan")
except ImportError as _e:
    if "plan" not in str(_e):
        raise


if __name__ == "__main__":
    main()
