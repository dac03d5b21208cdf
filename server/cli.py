"""`edge-hub`: the centre of the star. `serve` runs the hub; `plan` is the StarSD system model
(server/planner.py); `demo` and `demo-sun` run the demos of server/demos/, imported only
inside those commands (the demos train with export/, which the hub itself never needs)."""
from __future__ import annotations

import logging
import signal
import threading
import time
from pathlib import Path

import click

from edge.command_options import (ctl_key_option, draft_limits, draft_options, open_model_for_command,
                                  read_ctl_key, read_password)


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
@click.option("--port", default=1883, show_default=True, help="loopback port of the broker started here")
@click.option("--listen", "listen", multiple=True, metavar="ADDR[:PORT]",
              help="also listen here for devices (repeatable; default: loopback only). Beyond loopback "
                   "this needs --acl and --tls-dir (Mosquitto), unless --insecure")
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
def serve(broker_url, mosquitto, port, listen, tls_dir, insecure, acl, users, username, password, password_file,
          draft_model, hub_id, dtype, threads, max_len, stats_every, sun_isolated, sun_pools, sun_decoder,
          sun_max_batch, stop_ids, sun_http_port, sun_http_host, sun_tokenizer, ctl_key_file, sun_backend,
          **limits):
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
        from edge.checkpoint import CheckpointError, load_tokenizer
        try:
            sun_tok = load_tokenizer(sun_tokenizer)     # a model name or a path
        except CheckpointError as e:
            raise click.ClickException(f"--sun-tokenizer {sun_tokenizer}: {e}") from None
    decoder = None
    if sun_decoder:
        from edge.engines.base import EngineError
        from edge.roles.decoder import SharedDecoder
        from edge.sun import SunError
        try:
            decoder = SharedDecoder.from_dir(sun_decoder, threads=threads, max_batch=sun_max_batch,
                                             stop_ids=stop_ids, name=f"{hub_id}-decoder", backend=sun_backend)
        except (SunError, OSError, EngineError) as e:
            raise click.ClickException(f"--sun-decoder {sun_decoder}: {e}") from None
    engine = tok_fp = None
    if draft_model:
        engine, tok = open_model_for_command(draft_model, dtype, threads, max_len)
        tok_fp = tok.fingerprint()
    else:
        click.echo("no --draft-model: this hub only routes to draft services on devices "
                   "(`edge-agent run --role draft`)", err=True)
    hub = Hub(broker_url=broker_url, broker="mosquitto" if mosquitto else "embedded", port=port, acl=acl,
              draft_engine=engine, tokenizer_fp=tok_fp or "", limits=draft_limits(**limits), hub_id=hub_id,
              username=username, password=password, sun_isolated=sun_isolated, sun_pools=pools,
              sun_decoder=decoder, ctl_key=ctl_key, listeners=listeners)
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
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        while not stop.wait(stats_every or 3600):
            if stats_every:
                click.echo(_stats_line(hub), err=True)
    finally:
        if http is not None:
            http.stop()
        hub.stop()


@main.command()
@click.option("--out", required=True, type=click.Path(file_okay=False), help="directory of the star's certificates")
@click.option("--host", "hosts", multiple=True, metavar="NAME|ADDR",
              help="a name or address devices reach the hub by (repeatable; the broker's certificate)")
@click.option("--device", "devices", multiple=True, metavar="CLIENT_ID",
              help="one client certificate per device / service (repeatable; CN = its client id)")
def certs(out, hosts, devices):
    """Make (or extend) the star's CA, the broker's certificate and one per device."""
    from server.certs import CertError, make_certs
    from edge.protocol import ProtocolError
    try:
        written = make_certs(out, hosts or ("localhost", "127.0.0.1"), devices)
    except (CertError, ProtocolError) as e:
        raise click.ClickException(str(e)) from None
    for w in written:
        click.echo(f"wrote {w}", err=True)
    if not written:
        click.echo(f"{out}: every certificate asked for is already there", err=True)
    click.echo(f"copy ca.crt and clients/NAME.* to each device; keep ca.key here. Serve with "
               f"`edge-hub serve --mosquitto --acl --tls-dir {out} --listen ADDR`", err=True)


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


def _table_arg(spec: str, what: str) -> dict:
    """'1=40,2=45.5' -> {1: 40.0, 2: 45.5}."""
    out = {}
    for kv in (x for x in spec.split(",") if x.strip()):
        k, sep, v = kv.partition("=")
        try:
            out[int(k)] = float(v)
        except ValueError:
            raise click.BadParameter(f"{kv!r}: write K=VALUE pairs separated by commas", param_hint=what) from None
        if not sep:
            raise click.BadParameter(f"{kv!r}: write K=VALUE pairs separated by commas", param_hint=what)
    return out


@main.command()
@click.option("--measurements", type=click.Path(exists=True, dir_okay=False), default=None,
              help="JSON written by benchmarks/starsd_scaling.py: its measured inputs (flags below override)")
@click.option("--draft-step", default=None, metavar="B=MS,...",
              help="one batched draft step at batch size B, ms (measured), e.g. 1=40,4=55,16=120")
@click.option("--draft-feed-ms", type=float, default=None, help="per-request feed cost, ms")
@click.option("--profile", default=None, help="device profile of the targets (devices/profiles/*.toml)")
@click.option("--target-step-ms", type=float, default=None, help="one target decode step, ms")
@click.option("--verify-cost", default=None, metavar="K=COST,...",
              help="a target call over K tokens in single-step units, e.g. 1=1,3=1.05,5=1.1")
@click.option("--rtt-ms", type=float, default=None, help="network + protocol round trip, ms")
@click.option("--alpha", type=float, default=None, help="acceptance rate")
@click.option("--ns", default="1,2,4,8,16,32,64", show_default=True, help="numbers of targets")
@click.option("--gammas", default="1,2,3,4,5,6,8", show_default=True, help="γ values tried (best per N)")
@click.option("--gamma", type=int, default=None, help="fix γ instead of choosing the best")
def plan(measurements, draft_step, draft_feed_ms, profile, target_step_ms, verify_cost, rtt_ms, alpha, ns,
         gammas, gamma):
    """Predict StarSD throughput vs N, N_full and the best γ (the system model of server/planner.py)."""
    import json

    from server.planner import SystemInputs, format_table, simulate, sweep

    kw: dict = {}
    if measurements:
        try:
            got = json.loads(open(measurements).read())["planner"]["inputs"]
        except (ValueError, KeyError, TypeError):
            raise click.ClickException(f"{measurements} has no planner inputs: write it with "
                                       "benchmarks/starsd_scaling.py") from None
        kw = {"draft_step_ms": {int(k): float(v) for k, v in got["draft_step_ms"].items()},
              "draft_feed_ms": got["draft_feed_ms"], "target_step_ms": got["target_step_ms"],
              "verify_cost": {int(k): float(v) for k, v in got["verify_cost"].items()},
              "rtt_ms": got["rtt_ms"], "alpha": got["alpha"]}
    if profile:
        from devices.profile import load_profile
        try:
            p = load_profile(profile)
        except ValueError as e:
            raise click.BadParameter(str(e), param_hint="--profile") from None
        wb, params = 1_117_320_768, 1.54e9        # Qwen2.5-Coder-1.5B Q4_K_M, the reference target
        kw["target_step_ms"] = p.call_ms(wb, params, 1)
        kw["verify_cost"] = {k: p.verify_cost(k, wb, params) for k in range(1, 34)}
    given = {"draft_step_ms": draft_step and _table_arg(draft_step, "--draft-step"),
             "draft_feed_ms": draft_feed_ms, "target_step_ms": target_step_ms,
             "verify_cost": verify_cost and _table_arg(verify_cost, "--verify-cost"), "rtt_ms": rtt_ms,
             "alpha": alpha}
    kw.update({k: v for k, v in given.items() if v is not None})
    kw.setdefault("draft_feed_ms", 0.0)
    kw.setdefault("rtt_ms", 2.0)
    missing = [f"--{k.replace('_ms', '').replace('_', '-')}" for k in
               ("draft_step_ms", "target_step_ms", "verify_cost", "alpha") if not kw.get(k) and kw.get(k) != 0]
    if missing:
        raise click.UsageError(f"missing {', '.join(missing)}: pass them, or --measurements FILE from "
                               "benchmarks/starsd_scaling.py (and/or --profile for the target's costs)")
    if not 0.0 <= kw["alpha"] <= 1.0:
        raise click.BadParameter("must be in [0, 1]", param_hint="--alpha")
    try:
        n_list = [int(x) for x in ns.split(",") if x.strip()]
        g_list = [int(x) for x in gammas.split(",") if x.strip()]
    except ValueError:
        raise click.BadParameter("write comma-separated integers, e.g. 1,2,4,8") from None
    inp = SystemInputs(**kw)
    preds = [simulate(inp, n, gamma) for n in n_list] if gamma else sweep(inp, n_list, g_list)
    click.echo(f"draft step ms by batch {kw['draft_step_ms']}, target step {kw['target_step_ms']:.1f} ms, "
               f"rtt {kw['rtt_ms']:.1f} ms, alpha {kw['alpha']:.2f}")
    click.echo(format_table(preds))


@main.command("demo")
@click.option("--targets", "-N", "n_targets", default=4, show_default=True, help="targets in the star")
@click.option("--max-new", "-n", default=48, show_default=True, help="new tokens per target")
@click.option("--gamma", "-g", default=4, show_default=True, help="drafted tokens per verification")
@click.option("--draft", "-D", default="qwen2.5-coder-0.5b", show_default=True, help="the hub's draft model")
@click.option("--target", "-T", default="qwen2.5-coder-1.5b", show_default=True, help="every target's model")
@click.option("--backend", type=click.Choice(["llamacpp", "torch"]), default="llamacpp", show_default=True)
@click.option("--broker", type=click.Choice(["embedded", "mosquitto"]), default="embedded", show_default=True)
@click.option("--check", is_flag=True, help="then decode alone and compare each target's output")
@click.option("--plot", "plot_path", default=None, help="plot path [default: benchmarks/results/star_demo.png]")
@click.option("--live/--no-live", default=True, show_default=True, help="refresh the table in place")
@click.option("--show-text", is_flag=True, help="print each target's text at the end")
@click.option("--target-nice", default=5, show_default=True,
              help="lower the targets' priority so they do not starve the hub's draft on shared cores (0: off)")
def demo(**options):
    """StarSD on this machine: one hub + draft service, N targets, each on its own prompt."""
    from server.demos.star_demo import demo_command
    demo_command(**options)


@main.command("demo-sun")
@click.option("--requests", "n_requests", default=120, show_default=True, help="requests to serve")
@click.option("--rate", default=150.0, show_default=True, help="mean arrivals per second (Poisson)")
@click.option("--zipf", default=1.2, show_default=True, help="task popularity skew (Zipf exponent)")
@click.option("--max-batch", default=32, show_default=True, help="decoder: sequences per step")
@click.option("--work", default=str(Path(__file__).resolve().parent.parent / "runs" / "demo-sun"),
              show_default=True, type=click.Path(file_okay=False), help="where the specialists are made and cached")
@click.option("--seed", default=0, show_default=True)
def demo_sun(**options):
    """SUN: three task specialists share one int4 decoder over MQTT (trains tiny specialists once)."""
    from server.demos.sun_demo import demo_command
    demo_command(**options)


if __name__ == "__main__":
    main()
