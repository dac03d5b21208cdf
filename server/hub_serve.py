"""`edge-hub serve`: the hub daemon's command. Its options (shared ones from edge/cli/options.py)
are read into a HubConfig (server/hub_config.py, also from `--config hub.toml`) and handed to
run_hub, which loads what the hub hosts (its draft, a SUN decoder), starts it, registers the
broker's users and runs until SIGINT / SIGTERM.

Passwords the broker makes for `--user NAME` are written to the mode-600 file --credentials-out
names, never to the log (under systemd the log is journald, which others may read).
"""
from __future__ import annotations

import os
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import click

from edge.cli.broker_options import credential_options, ctl_key_option, keepalive_option, tls_dir_option
from edge.cli.options import (verbose_option, apply, backend_option, draft_options, hubs_option, model_options,
                              stop_ids_option, telemetry_options)
from edge.cli.sections import BROKER, DRAFT, HUB, SUN, SectionedCommand, option
from edge.cli.startup import (build_draft, leave_on_sigterm, open_model_for_command, resolve_for_command,
                              start_telemetry_for_command, wait_for_signal)
from edge.sun.worker_limits import DEFAULT_MAX_SEQUENCES
from server.hub_config import HubConfig, hub_config_from, hub_config_option

def broker_options(f):
    """Where the hub's broker is, how it listens, whom it admits."""
    return apply(f, [
        option(BROKER, "--broker", "broker_url", default=None, metavar="mqtt[s]://HOST:PORT[,...]",
               help="use this external MQTT broker, or the nodes of a cluster in the order to try them (the "
                    "same spelling as edge-agent run --broker; default: start one here)"),
        option(BROKER, "--mosquitto", is_flag=True, help="start Mosquitto instead of the embedded amqtt broker"),
        option(BROKER, "--port", default=1883, show_default=True, help="loopback port of the broker started here"),
        option(BROKER, "--listen", "listen", multiple=True, metavar="ADDR[:PORT]",
               help="also listen here for devices (repeatable; default: loopback only). Beyond loopback this needs "
                    "--acl and --tls-dir, unless --insecure"),
        tls_dir_option("certificates from `edge-hub certs`: --listen addresses speak mqtts:// and take only clients "
                       "with a certificate of this star (CN = client id); with an mqtts:// --broker: ca.crt and "
                       "the hub's own HUB.crt/.key (or clients/HUB.*; HUB = --username, else --hub-id)"),
        option(BROKER, "--insecure", is_flag=True,
               help="allow plain, unauthenticated --listen addresses beyond loopback (a network you trust)"),
        option(BROKER, "--acl", is_flag=True,
               help="broker started here: passwords + ACL (clients connect with username = client id)"),
        option(BROKER, "--user", "users", multiple=True, metavar="NAME[:ROLE[:PASSWORD]]",
               help="with --acl: register a client (role client), a draft service (role draft), a SUN worker (role "
                    "sun) or a monitor (role hub); without PASSWORD the hub makes one (needs --credentials-out)"),
        option(BROKER, "--credentials-out", default=None, type=click.Path(dir_okay=False), metavar="FILE",
               help="write every --user's NAME:ROLE:PASSWORD here, mode 600 (rewritten at each start: the passwords "
                    "made are new); the log only says where"),
        keepalive_option,
        credential_options,
        ctl_key_option,
    ])


def sun_options(f):
    """SUN routing, a decoder the hub hosts, the SUN tasks' OpenAI endpoint."""
    return apply(f, [
        option(SUN, "--sun-isolated", is_flag=True,
               help="one decoder pool per task (the conventional baseline) instead of one shared pool"),
        option(SUN, "--sun-pool", "sun_pools", multiple=True, metavar="TASK=DEC1,DEC2",
               help="with --sun-isolated: the decoders that serve TASK (repeatable; default: each task binds one "
                    "free decoder)"),
        option(SUN, "--sun-decoder", default=None, metavar="DIR",
               help="also run this shared decoder inside the hub (export.tune.save_decoder dir; a bundle with "
                    "--sun-backend)"),
        option(SUN, "--sun-max-batch", default=64, show_default=True, help="--sun-decoder: sequences per step"),
        option(SUN, "--sun-max-sequences", default=DEFAULT_MAX_SEQUENCES, show_default=True,
               help="--sun-decoder: sequences it holds, running and waiting; past it requests are refused "
                    "(overloaded)"),
        backend_option("--sun-backend", section=SUN,
                       help="--sun-decoder: runtime (onnx/llamacpp take a bundle, e.g. a Q4_0 GGUF of the int4 "
                            "decoder)"),
        stop_ids_option("--sun-decoder"),
        option(SUN, "--sun-http-port", default=0, show_default=True,
               help="serve the SUN tasks on an OpenAI-compatible endpoint here (model = task; 0: off)"),
        option(SUN, "--sun-http-host", default="127.0.0.1", show_default=True),
        option(SUN, "--sun-request-timeout", type=float, default=300.0, show_default=True, metavar="SECONDS",
               help="with --sun-http-port: how long a request may take in all before it is a 503 (a burst "
                    "queued at a prefill worker on a small CPU takes minutes)"),
        option(SUN, "--sun-grammars-on-demand", is_flag=True,
               help="with --sun-http-port: build llguidance's tokenizer at the first request with a grammar, not "
                    "at start (~80 MB less on Qwen's 150k vocabulary until then; that request waits seconds)"),
        option(SUN, "--sun-tokenizer", default=None, metavar="MODEL",
               help="with --sun-http-port: the SUN base model (name or path) whose tokenizer the tasks share; "
                    "--sun-decoder follows request grammars with it too"),
    ])


@click.command("serve", cls=SectionedCommand)
@hub_config_option
@broker_options
@option(HUB, "--hub-id", default="hub", show_default=True)
@hubs_option(HUB, "this one's --hub-id included, the same list on every hub and target")
@option(HUB, "--stats-every", default=5.0, show_default=True, help="seconds between stats lines (0: off)")
@model_options
@option(DRAFT, "--draft-model", default=None, help="model name or path of the hub's own draft service")
@backend_option("--draft-backend", default="auto", section=DRAFT,
                help="the hub draft's engine: auto (a GGUF on llama.cpp where it is installed; the start line "
                     "says why), torch, llamacpp (--gpu-layers), onnx")
@option(DRAFT, "--verify-model", default=None,
        help="the reverse star: a target the hub holds to verify the drafts of devices too small for it "
             "(`edge-agent run --role drafter`), beside its draft service; same tokenizer as theirs")
@backend_option("--verify-backend", default="auto", section=DRAFT,
                help="the hub target's engine for --verify-model (auto, torch, llamacpp, onnx)")
@option(DRAFT, "--client-share", default=0.5, show_default=True, type=click.FloatRange(0.0, 1.0, min_open=True),
        help="the most of the draft slots that fit its model one client may hold (others keep room)")
@draft_options
@sun_options
@telemetry_options
@verbose_option
def serve(**options):
    """Run the hub until Ctrl-C."""
    run_hub(hub_config_from(options))


def run_hub(cfg: HubConfig) -> None:
    """Load what the hub hosts, start it, register its users, serve until a signal, stop."""
    sun_tok = _sun_tokenizer(cfg)
    hub = _make_hub(cfg)
    stop = leave_on_sigterm()             # from before devices can see the hub
    _start(hub)
    http, telemetry = None, []
    try:
        _register_users(hub, cfg)
        _announce(hub, cfg)
        http = _start_sun_http(hub, cfg, sun_tok)
        telemetry = _hub_telemetry(hub, cfg)
        wait_for_signal(stop, cfg.stats_every or 3600,
                        (lambda: click.echo(stats_line(hub), err=True)) if cfg.stats_every else None)
    finally:
        for t in telemetry:
            t.stop()
        if http is not None:
            http.stop()
        hub.stop()


def _make_hub(cfg: HubConfig):
    """The Hub with its SUN decoder and its own draft service of any --drafter kind, loaded."""
    from server.hub import Hub

    decoder = _sun_decoder(cfg)
    core, tok = None, None
    if cfg.draft is not None:
        # resolved once here (a suffix draft reads only its tokenizer: any of a bundle's artifacts names it)
        model = resolve_for_command(cfg.draft.model, cfg.draft_backend,
                                    None if cfg.draft.kind == "suffix" else "draft")
        core, tok = build_draft(replace(cfg.draft, model=model), f"{cfg.hub_id}-draft",
                                lambda: open_model_for_command(model, cfg.dtype, cfg.threads, cfg.max_len,
                                                               device=cfg.device, gpu_layers=cfg.gpu_layers,
                                                               repack=cfg.repack))
    else:
        click.echo("no --draft-model: this hub only routes to draft services on devices "
                   "(`edge-agent run --role draft`)", err=True)
    b, sun = cfg.broker, cfg.sun
    kw = dict(broker_url=b.url, broker=b.kind, port=b.port, acl=b.acl, draft_core=core,
              tokenizer_fp=tok.fingerprint() if tok is not None else "", hub_id=cfg.hub_id, username=b.username,
              password=b.password, sun_isolated=sun.isolated, sun_pools=sun.pools, sun_decoder=decoder,
              ctl_key=cfg.ctl_key, listeners=b.listeners, client_share=cfg.client_share, hubs=cfg.hubs,
              keepalive=b.keepalive, **verify_target(cfg))
    if b.tls is not None:                 # an external mqtts:// broker: every link with the hub's certificate
        from server.hub_external import ExternalTlsHub
        return ExternalTlsHub(tls=b.tls, **kw)
    return Hub(**kw)


def verify_target(cfg: HubConfig) -> dict:
    """The Hub's arguments for its verify service (the reverse star): none without --verify-model."""
    if not cfg.verify_model:
        return {}
    from edge.memory.fit import engine_kwargs
    model = resolve_for_command(cfg.verify_model, cfg.verify_backend, "target")
    # one sequence per session (llama.cpp: n_seq_max), so --max-sessions is what it can hold
    engine, tok = open_model_for_command(model, cfg.dtype, cfg.threads, cfg.max_len, device=cfg.device,
                                         gpu_layers=cfg.gpu_layers, repack=cfg.repack, exact_rows=cfg.exact_rows,
                                         **engine_kwargs(model.backend, "target", cfg.verify_limits.max_sessions))
    from edge.speculative.grammar import grammar_tokenizer
    # grammars (a drafting device's response_format / tool_choice) compiled against the target's tokenizer,
    # made at the first one asked for (a 150k vocabulary takes about a second)
    return dict(verify_engine=engine, verify_fp=tok.fingerprint(), verify_limits=cfg.verify_limits,
                verify_grammars=lambda: grammar_tokenizer(tok, engine.vocab_size))


def _sun_tokenizer(cfg: HubConfig):
    if not cfg.sun.http_port:
        return None
    from edge.engines.base import EngineError
    from edge.engines.free_heap import give_back_free_heap
    from edge.engines.loader import open_tokenizer
    from edge.model.checkpoint_files import CheckpointError
    from edge.model.resolved import resolve
    try:
        tok = open_tokenizer(resolve(cfg.sun.tokenizer))     # a model name or a path
    except (CheckpointError, EngineError) as e:
        raise click.ClickException(f"--sun-tokenizer {cfg.sun.tokenizer}: {e}") from None
    give_back_free_heap()     # reading a GGUF's 150k-token vocabulary frees ~2x what the tokenizer keeps
    return tok


def _sun_decoder(cfg: HubConfig):
    sun = cfg.sun
    if not sun.decoder_dir:
        return None
    from edge.engines.base import EngineError
    from edge.model.sun_error import SunError
    from edge.cli.placing import place_model
    from edge.sun.decoder import SharedDecoder
    # resolved here: --sun-backend auto becomes the bundle's decoder artifact (llama.cpp: the decoder sizes
    # its context's sequences for it) or torch for a tuned directory
    model = resolve_for_command(sun.decoder_dir, sun.backend, "decoder")
    placement = place_model(model, cfg.device, cfg.gpu_layers, repack=cfg.repack)
    try:
        decoder = SharedDecoder.from_dir(model, threads=cfg.threads, max_batch=sun.max_batch,
                                         stop_ids=sun.stop_ids, name=f"{cfg.hub_id}-decoder", backend=model.backend,
                                         max_sequences=sun.max_sequences, engine_kw=placement.engine_kwargs())
        from edge.sun.worker_tokenizer import worker_grammars     # --sun-tokenizer: it follows request grammars
        decoder.grammars = worker_grammars(model, sun.tokenizer, decoder.engine.vocab_size)
    except (SunError, OSError, EngineError) as e:
        raise click.ClickException(f"--sun-decoder {sun.decoder_dir}: {e}") from None
    click.echo(f"SUN decoder: {decoder.engine.where()}", err=True)
    return decoder


def _start(hub) -> None:
    from server.broker import BrokerError
    try:
        hub.start()
    except BrokerError as e:
        raise click.ClickException(str(e)) from None
    except Exception as e:  # LinkError and friends carry a message that says what to do
        raise click.ClickException(f"the hub could not start: {e}") from None


def _register_users(hub, cfg: HubConfig) -> None:
    """Each --user into the broker's ACL; the passwords go to --credentials-out, not to the log."""
    from server.broker import BrokerError
    rows = []
    for user in cfg.broker.users:
        try:
            rows.append((user.name, user.role, hub.broker.add_user(user.name, user.role, user.password)))
        except BrokerError as e:
            raise click.ClickException(f"--user {user.name}: {e}") from None
    out = cfg.broker.credentials_out
    if out and rows:
        try:
            write_credentials(out, rows, cfg.hub_id)
        except OSError as e:
            raise click.ClickException(f"--credentials-out {out}: {e.strerror}") from None
    for user in cfg.broker.users:
        where = f"password in {out}" if out else "password as given"
        click.echo(f"user {user.name} ({user.role}): {where}", err=True)


def write_credentials(path, rows, hub_id: str) -> None:
    """NAME:ROLE:PASSWORD lines, created mode 600 and moved into place whole (never readable by
    others, never half-written)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)   # mkstemp creates it mode 600
    try:
        with os.fdopen(fd, "w") as f:
            f.write(f"# the broker users of hub {hub_id}, NAME:ROLE:PASSWORD, new at each `edge-hub serve` start;\n"
                    "# give each device its own password (edge-agent run --password-file)\n")
            f.writelines(f"{name}:{role}:{pw}\n" for name, role, pw in rows)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _announce(hub, cfg: HubConfig) -> None:
    d = cfg.draft
    click.echo(f"hub {cfg.hub_id} serving on {hub.url}" + (f" with draft {d.model} ({d.kind})" if d else "")
               + (f" and SUN decoder {hub.sun_node.id}" if hub.sun_node else ""), err=True)
    for ln in cfg.broker.listeners:
        click.echo(f"devices: {ln.url}" + ("" if ln.tls or ln.loopback else
                                          "  (INSECURE: plain and unauthenticated beyond loopback)"), err=True)


def _start_sun_http(hub, cfg: HubConfig, sun_tok):
    if not cfg.sun.http_port:
        return None
    from server.sun_http import start_sun_http
    host, port = cfg.sun.http_host, cfg.sun.http_port
    try:
        http = start_sun_http(hub, sun_tok, host=host, port=port, timeout=cfg.sun.request_timeout,
                              warm=not cfg.sun.grammars_on_demand)
    except OSError as e:
        raise click.ClickException(f"--sun-http-port {port}: {e}") from None
    click.echo(f"SUN tasks on http://{host}:{http.port}/v1 (model = task)", err=True)
    return http


def _hub_telemetry(hub, cfg: HubConfig) -> list:
    """The hub's own telemetry (and its verify service's row: `edge-hub top` shows both directions);
    its /metrics also carries every device's (server/telemetry_board.py)."""
    board = None
    if cfg.telemetry.metrics_port:
        from server.telemetry_board import TelemetryBoard
        board = TelemetryBoard(hub.link, cfg.ctl_key).start()
    out = [start_telemetry_for_command(hub.link, hub.hub_id, "hub", hub.telemetry, cfg.telemetry,
                                       ctl_key=cfg.ctl_key, board=board)]
    if hub.verify is not None:
        out.append(start_telemetry_for_command(hub.verify.link, hub.verify.node.id, "verify", hub.verify.node.telemetry,
                                               replace(cfg.telemetry, metrics_port=0), ctl_key=cfg.ctl_key))
    return [t for t in out if t is not None]


def stats_line(hub) -> str:
    s = hub.snapshot()
    c = s["counters"]
    line = (f"{time.strftime('%H:%M:%S')} sessions={s['registry']['sessions']} joins={c['joins']} "
            f"refused={c['refused']}")
    d = s.get("draft")
    if d:
        line += (f" requests={d['requests']} busy={d['busy_ratio']:.2f} batch={d['batch_size_mean']:.1f}"
                 f" t_idle={1e3 * d['t_idle_mean_s']:.1f}ms dropped={sum(s['dropped'].values())}")
    v = s.get("verify")
    if v:
        line += (f" verify: sessions={v['sessions']} requests={v['requests']} batch={v['batch_size_mean']:.1f}"
                 f" accept={v['acceptance'] or 0:.2f}")
        steps = v.get("step_of_b") or {}                  # its batched verify call by sessions in it, mean ms
        if steps:
            line += f" busy_s={v['busy_s']:.1f} calls=" + ",".join(
                f"{b}:{x['steps']}x{1e3 * x['mean_s']:.0f}ms" for b, x in steps.items())
    sun = s.get("sun")
    if sun and (sun["workers"] or sun["counters"]["requests"]):
        online = sum(w["online"] for w in sun["workers"].values())
        line += f" sun_workers={online} sun_routed={sun['counters']['routed']}"
    return line
