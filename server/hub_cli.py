"""`edge-hub`: the centre of the star. `serve` runs the hub; `plan` is the StarSD system model
(server/planner.py); `demo` and `demo-sun` run the demos of server/demos/, imported only
inside those commands (the demos train with export/, which the hub itself never needs)."""
from __future__ import annotations

import logging
import signal
import time
from pathlib import Path

import click

from edge.cli.options import (STAR_GAMMA, ctl_key_option, draft_core_for_command, draft_limits, draft_options,
                                  drafter_options, leave_on_sigterm, open_model_for_command,
                                  read_ctl_key, read_password, start_telemetry_for_command, telemetry_options,
                                  tls_files)
from edge.sun.limits import DEFAULT_MAX_SEQUENCES
from server.demos.commands import demo, demo_sun
from server.throughput_plan import plan


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("-v", "--verbose", count=True, help="-v info, -vv debug logging")
def main(verbose):
    """StarSun hub: MQTT broker, registry and draft service for a star of devices."""
    logging.basicConfig(level=[logging.WARNING, logging.INFO, logging.DEBUG][min(verbose, 2)],
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")


main.add_command(plan)


@main.command()
@click.option("--broker", "broker_url", default=None, metavar="mqtt://HOST:PORT",
              help="use this MQTT broker (default: start one here)")
@click.option("--mosquitto", is_flag=True, help="start Mosquitto instead of the embedded amqtt broker")
@click.option("--port", default=1883, show_default=True, help="loopback port of the broker started here")
@click.option("--listen", "listen", multiple=True, metavar="ADDR[:PORT]",
              help="also listen here for devices (repeatable; default: loopback only). Beyond loopback "
                   "this needs --acl and --tls-dir, unless --insecure")
@click.option("--tls-dir", default=None, type=click.Path(file_okay=False),
              help="certificates from `edge-hub certs`: --listen addresses speak mqtts:// and take "
                   "only clients with a certificate of this star (CN = client id)")
@click.option("--insecure", is_flag=True,
              help="allow plain, unauthenticated --listen addresses beyond loopback (a network you trust)")
@click.option("--acl", is_flag=True,
              help="broker started here: passwords + ACL (clients connect with username = client id)")
@click.option("--user", "users", multiple=True, metavar="NAME[:ROLE[:PASSWORD]]",
              help="with --acl: register a client (role client), a draft service (role draft) "
                   "or a SUN worker (role sun)")
@click.option("--client-share", default=0.5, show_default=True, type=click.FloatRange(0.0, 1.0, min_open=True),
              help="the most of the draft slots that fit its model one client may hold (others keep room)")
@click.option("--username", default=None, help="hub's username on an external --broker")
@click.option("--password", default=None, help="hub's password on an external --broker (visible in ps: "
              "prefer --password-file or $STARSUN_MQTT_PASSWORD)")
@click.option("--password-file", default=None, type=click.Path(dir_okay=False),
              help="file holding the hub's password on an external --broker")
@click.option("--draft-model", default=None, help="model name or path of the hub's own draft service")
@click.option("--hub-id", default="hub", show_default=True)
@click.option("--dtype", default="float32", type=click.Choice(["float32", "float64", "bfloat16"]),
              show_default=True)
@click.option("--threads", default=None, type=int,
              help="torch threads for large calls (default: 1 on <= 4 cores; calls over <= 5 rows always use 1)")
@click.option("--max-len", default=4096, show_default=True, help="context cap per session")
@click.option("--stats-every", default=5.0, show_default=True, help="seconds between stats lines (0: off)")
@click.option("--sun-isolated", is_flag=True,
              help="SUN: one decoder pool per task (the conventional baseline) instead of one shared pool")
@click.option("--sun-pool", "sun_pools", multiple=True, metavar="TASK=DEC1,DEC2",
              help="with --sun-isolated: the decoders that serve TASK "
                   "(repeatable; default: each task binds one free decoder)")
@click.option("--sun-decoder", default=None, metavar="DIR",
              help="SUN: also run this shared decoder inside the hub (export.tune.save_decoder dir; a bundle with --sun-backend)")
@click.option("--sun-max-batch", default=64, show_default=True, help="--sun-decoder: sequences per step")
@click.option("--sun-max-sequences", default=DEFAULT_MAX_SEQUENCES, show_default=True,
              help="--sun-decoder: sequences it holds, running and waiting; past it requests are refused "
                   "(overloaded)")
@click.option("--sun-backend", default="torch", show_default=True, type=click.Choice(["torch", "onnx", "llamacpp", "auto"]),
              help="--sun-decoder: runtime (onnx/llamacpp take a bundle, e.g. a Q4_0 GGUF of the int4 decoder)")
@click.option("--stop-id", "stop_ids", multiple=True, type=int,
              help="--sun-decoder: extra end-of-sequence token ids (repeatable)")
@click.option("--sun-http-port", default=0, show_default=True,
              help="serve the SUN tasks on an OpenAI-compatible endpoint here (model = task; 0: off)")
@click.option("--sun-http-host", default="127.0.0.1", show_default=True)
@click.option("--sun-tokenizer", default=None, metavar="MODEL",
              help="with --sun-http-port: the SUN base model (name or path) whose tokenizer the tasks share")
@ctl_key_option
@draft_options
@drafter_options
@telemetry_options
def serve(broker_url, mosquitto, port, listen, tls_dir, insecure, acl, users, client_share, username, password,
          password_file, draft_model, hub_id, dtype, threads, max_len, stats_every, sun_isolated, sun_pools,
          sun_decoder, sun_max_batch, sun_max_sequences, stop_ids, sun_http_port, sun_http_host, sun_tokenizer, ctl_key_file, sun_backend,
          telemetry_interval, metrics_port, metrics_host, **limits):
    """Run the hub until Ctrl-C."""
    from server.broker import BrokerError
    from server.hub import Hub
    from server.listen import listeners_for

    password = read_password(password, password_file)
    if broker_url and (listen or tls_dir):
        raise click.UsageError("--listen and --tls-dir configure a broker started here; not with --broker")
    try:
        listeners = listeners_for(listen, tls_dir, insecure, acl)
    except ValueError as e:
        raise click.UsageError(str(e)) from None

    if broker_url and (mosquitto or acl or users):
        raise click.UsageError("--mosquitto, --acl and --user configure a broker started here; "
                               "they do not apply with --broker")
    if users and not acl:
        raise click.UsageError("--user needs --acl (without an ACL anyone may connect)")
    ctl_key = read_ctl_key(ctl_key_file)
    pools = _parse_pools(sun_pools)
    if pools and not sun_isolated:
        raise click.UsageError("--sun-pool gives a task its own decoders: it needs --sun-isolated")
    sun_tok = None
    if sun_http_port:
        if not sun_tokenizer:
            raise click.UsageError("--sun-http-port needs --sun-tokenizer (the SUN base model, e.g. smollm2-135m)")
        from edge.model.checkpoint_files import CheckpointError, load_tokenizer
        try:
            sun_tok = load_tokenizer(sun_tokenizer)     # a model name or a path
        except CheckpointError as e:
            raise click.ClickException(f"--sun-tokenizer {sun_tokenizer}: {e}") from None
    decoder = None
    if sun_decoder:
        from edge.engines.base import EngineError
        from edge.sun.decoder import SharedDecoder
        from edge.model.sun_error import SunError
        try:
            decoder = SharedDecoder.from_dir(sun_decoder, threads=threads, max_batch=sun_max_batch,
                                             stop_ids=stop_ids, name=f"{hub_id}-decoder", backend=sun_backend,
                                             max_sequences=sun_max_sequences)
        except (SunError, OSError, EngineError) as e:
            raise click.ClickException(f"--sun-decoder {sun_decoder}: {e}") from None
    engine = tok_fp = core = None
    drafter, min_score = limits.pop("drafter"), limits.pop("suffix_min_score")
    if drafter != "model" and not draft_model:
        raise click.UsageError(f"--drafter {drafter} needs --draft-model (for suffix: only its tokenizer "
                               "is loaded, to serve the targets that share it)")
    if draft_model and drafter == "suffix":       # no weights: the tokenizer says whom it serves
        from edge.cli.options import suffix_identity
        tok, vocab = suffix_identity(draft_model)
        tok_fp = tok.fingerprint()
        core = draft_core_for_command("suffix", None, draft_limits(**limits), f"{hub_id}-draft", vocab_size=vocab)
    elif draft_model:
        engine, tok = open_model_for_command(draft_model, dtype, threads, max_len)
        tok_fp = tok.fingerprint()
        if drafter == "hybrid":
            core = draft_core_for_command("hybrid", engine, draft_limits(**limits), f"{hub_id}-draft",
                                          min_score=min_score)
    else:
        click.echo("no --draft-model: this hub only routes to draft services on devices "
                   "(`edge-agent run --role draft`)", err=True)
    hub = Hub(broker_url=broker_url, broker="mosquitto" if mosquitto else "embedded", port=port, acl=acl,
              draft_engine=engine, draft_core=core, tokenizer_fp=tok_fp or "", limits=draft_limits(**limits),
              hub_id=hub_id, username=username, password=password, sun_isolated=sun_isolated, sun_pools=pools,
              sun_decoder=decoder, ctl_key=ctl_key, listeners=listeners, client_share=client_share)
    stop = leave_on_sigterm()             # from before devices can see the hub
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
    click.echo(f"hub {hub_id} serving on {hub.url}" + (f" with draft {draft_model} ({drafter})" if draft_model else "")
               + (f" and SUN decoder {hub.sun_node.id}" if hub.sun_node else ""), err=True)
    for ln in listeners:
        click.echo(f"devices: {ln.url}" + ("" if ln.tls or ln.loopback else
                                          "  (INSECURE: plain and unauthenticated beyond loopback)"), err=True)
    http = None
    if sun_http_port:
        from server.sun_http import start_sun_http
        try:
            http = start_sun_http(hub, sun_tok, host=sun_http_host, port=sun_http_port)
        except OSError as e:
            hub.stop()
            raise click.ClickException(f"--sun-http-port {sun_http_port}: {e}") from None
        click.echo(f"SUN tasks on http://{sun_http_host}:{http.port}/v1 (model = task)", err=True)
    telemetry = _hub_telemetry(hub, ctl_key, telemetry_interval, metrics_host, metrics_port, http)
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    try:
        while not stop.wait(stats_every or 3600):
            if stats_every:
                click.echo(_stats_line(hub), err=True)
    finally:
        if telemetry is not None:
            telemetry.stop()
        if http is not None:
            http.stop()
        hub.stop()


def _hub_telemetry(hub, ctl_key, interval, metrics_host, metrics_port, http):
    """The hub's own telemetry; its /metrics also carries every device's (server/telemetry_board.py)."""
    board = None
    if metrics_port:
        from server.telemetry_board import TelemetryBoard
        board = TelemetryBoard(hub.link, ctl_key).start()
    try:
        return start_telemetry_for_command(hub.link, hub.hub_id, "hub", hub.telemetry, interval, metrics_host,
                                           metrics_port, ctl_key=ctl_key, board=board)
    except click.ClickException:
        if http is not None:
            http.stop()
        hub.stop()
        raise


@main.command()
@click.option("--out", required=True, type=click.Path(file_okay=False), help="directory of the star's certificates")
@click.option("--host", "hosts", multiple=True, metavar="NAME|ADDR",
              help="a name or address devices reach the hub by (repeatable; the broker's certificate)")
@click.option("--device", "devices", multiple=True, metavar="CLIENT_ID",
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


@main.command()
@click.option("--hub", "hub_url", required=True, metavar="mqtt[s]://HOST:PORT", help="the star's MQTT broker")
@click.option("--username", default=None,
              help="broker user allowed to read every device's telemetry: with the hub's ACL a user of role "
                   "hub (`edge-hub serve --acl --user monitor:hub`)")
@click.option("--password", default=None, help="its password (visible in ps: prefer --password-file or "
              "$STARSUN_MQTT_PASSWORD)")
@click.option("--password-file", default=None, type=click.Path(dir_okay=False), help="file holding the password")
@click.option("--tls-dir", default=None, type=click.Path(file_okay=False),
              help="with an mqtts:// --hub: ca.crt and CLIENT_ID.crt/.key from `edge-hub certs`")
@click.option("--client-id", default=None, help="certificate name for --tls-dir (default: --username, else top)")
@ctl_key_option
@click.option("--once", is_flag=True, help="print one snapshot and exit (scripts, tests)")
@click.option("--refresh", default=2.0, show_default=True, help="seconds between redraws")
@click.option("--wait", default=3.0, show_default=True,
              help="seconds to wait at most for the retained reports before the first table")
def top(hub_url, username, password, password_file, tls_dir, client_id, ctl_key_file, once, refresh, wait):
    """A live table of every device in the star, from its telemetry (ss/dev/+/telemetry)."""
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
