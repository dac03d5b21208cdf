"""`edge-agent run`: put this device into a star as a target, a draft service or a SUN worker.

target:  verifies locally, drafts come from the hub's star (StarSD); serves an
         OpenAI-compatible endpoint to local clients (--http-port), or
         generates once for --prompt and exits.
draft:   a draft service that registers with the hub and takes sessions.
prefill: SUN: one task specialist's prefill module (--module DIR, --task);
         the hub routes that task's requests here, the KV goes to a decoder.
decoder: SUN: a shared decoder (--module DIR) batching requests of every task.
"""
from __future__ import annotations

import logging
import signal
import socket
import sys
import threading

import click

from edge.cli.agent_config import config_option
from edge.cli.options import (STAR_GAMMA, ctl_key_option, draft_core_for_command, draft_limits,
                                  draft_options, drafter_options, leave_on_sigterm, open_model_for_command,
                                  read_ctl_key, read_password, start_telemetry_for_command, telemetry_options,
                                  tls_files)
from edge.cli.plan_command import check_before_load, memory_options
from edge.sun.limits import DEFAULT_MAX_QUEUE, DEFAULT_MAX_SEQUENCES


def _wait_for_signal(stop: threading.Event) -> None:
    """Until SIGINT or SIGTERM (leave_on_sigterm) sets `stop`. SIGINT only from here: Ctrl-C while
    the model loads still interrupts at once."""
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    while not stop.wait(3600):
        pass


@click.command()
@config_option
@click.option("--role", required=True, type=click.Choice(["target", "draft", "prefill", "decoder"]))
@click.option("--hub", "hub_url", required=True, metavar="mqtt://HOST:PORT", help="the hub's MQTT broker")
@click.option("--model", "-m", default=None, help="target/draft: model name (see edge.model.fetch) or path")
@click.option("--module", "module_dir", default=None, metavar="DIR",
              help="prefill/decoder: the specialist or shared-decoder directory (edge-export tune)")
@click.option("--task", default=None, help="prefill: the task it serves (default: the manifest's)")
@click.option("--max-batch", default=64, show_default=True, help="decoder: sequences per engine step")
@click.option("--max-sequences", default=DEFAULT_MAX_SEQUENCES, show_default=True,
              help="decoder: sequences it holds, running and waiting; past it requests are refused (overloaded)")
@click.option("--max-queue", default=DEFAULT_MAX_QUEUE, show_default=True,
              help="prefill: prompts waiting; past it requests are refused (overloaded)")
@click.option("--stop-id", "stop_ids", multiple=True, type=int,
              help="decoder: extra end-of-sequence token ids (repeatable)")
@click.option("--client-id", default=None, help="this device's id (default: the host name)")
@click.option("--username", default=None, help="broker username (with the hub's ACL: the client id)")
@click.option("--password", default=None, help="broker password the hub issued (visible in ps: prefer "
              "--password-file or $STARSUN_MQTT_PASSWORD)")
@click.option("--password-file", default=None, type=click.Path(dir_okay=False),
              help="file holding the broker password the hub issued")
@click.option("--tls-dir", default=None, type=click.Path(file_okay=False),
              help="with an mqtts:// --hub: ca.crt and this client's CLIENT_ID.crt/.key "
                   "(or clients/CLIENT_ID.*), from `edge-hub certs`")
@click.option("--gamma", "-g", default="4", show_default=True, type=STAR_GAMMA, metavar="γ|auto[:N]",
              help="target: drafted tokens per verification, or `auto` (0..8 each round from the acceptance, "
                   "the verify cost and the round trip; `auto:N` for 0..N)")
@click.option("--http-host", default="127.0.0.1", show_default=True)
@click.option("--http-port", default=8000, show_default=True, help="target: OpenAI endpoint port (0: none)")
@click.option("--prompt", default=None, help="target: generate once for this prompt and exit")
@click.option("--max-new", "-n", default=128, show_default=True, help="target with --prompt: new tokens")
@click.option("--temperature", "-t", default=0.0, show_default=True, help="target with --prompt: 0 = greedy")
@click.option("--backend", "-b", default="torch", show_default=True,
              type=click.Choice(["torch", "onnx", "llamacpp", "auto"]),
              help="engine: torch (checkpoints), onnx / llamacpp (a bundle or .onnx / .gguf file); "
                   "prefill/decoder: torch (the tuned directory) or onnx (its bundle)")
@click.option("--dtype", default="float32", type=click.Choice(["float32", "float64", "bfloat16"]),
              show_default=True)
@click.option("--threads", default=None, type=int,
              help="torch threads for large calls (default: 1 on <= 4 cores; calls over <= 5 rows always use 1)")
@click.option("--max-len", default=4096, show_default=True, help="context cap per sequence")
@click.option("-v", "--verbose", count=True, help="-v info, -vv debug logging")
@ctl_key_option
@memory_options
@draft_options
@drafter_options
@telemetry_options
def run(role, hub_url, model, module_dir, task, max_batch, max_sequences, max_queue, stop_ids, client_id,
        username, password,
        password_file, tls_dir, gamma,
        http_host, http_port, prompt, max_new, temperature, backend, dtype, threads, max_len, verbose,
        ctl_key_file, profile, memory_budget, telemetry_interval, metrics_port, metrics_host, **limits):
    """Join the star at --hub as a target, a draft service or a SUN worker (runs until Ctrl-C)."""
    from edge.wire.link import LinkError, MqttLink, parse_url
    from edge.wire.protocol import ProtocolError, check_id

    logging.basicConfig(level=[logging.WARNING, logging.INFO, logging.DEBUG][min(verbose, 2)],
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    client_id = client_id or username or socket.gethostname().split(".")[0]
    try:
        check_id(client_id, "--client-id")
        parse_url(hub_url)
    except (ProtocolError, LinkError) as e:
        raise click.BadParameter(str(e)) from None
    password = read_password(password, password_file)
    if password and not username:
        username = client_id
    tls = tls_files(tls_dir, client_id, hub_url)
    ctl_key = read_ctl_key(ctl_key_file)
    tele = dict(telemetry_interval=telemetry_interval, metrics_host=metrics_host, metrics_port=metrics_port,
                ctl_key=ctl_key)        # signed like every control message when there is a key
    if role in ("prefill", "decoder"):           # SUN: the module dir carries its own model
        if not module_dir:
            raise click.UsageError(f"--role {role} needs --module DIR "
                                   "(a SUN specialist or shared-decoder directory)")
        check_before_load(role, module_dir, "torch" if backend == "auto" else backend, None, profile,
                          memory_budget, max_batch=max_batch)   # a role that does not fit is refused here
        _run_sun(role, MqttLink(hub_url, username=username, password=password, tls=tls), module_dir, client_id,
                 task, threads, max_batch, stop_ids, backend, ctl_key, tele=tele,
                 limits=dict(max_sequences=max_sequences, max_queue=max_queue))
        return
    if not model:
        raise click.UsageError(f"--role {role} needs --model")
    drafter, min_score = limits.pop("drafter"), limits.pop("suffix_min_score")
    if drafter != "model" and role != "draft":
        raise click.UsageError(f"--drafter {drafter} is for --role draft (a target verifies; the hub or a "
                               "draft service drafts)")
    if role == "draft" and drafter == "suffix":      # no weights: the tokenizer says whom it serves
        from edge.cli.options import suffix_identity
        tok, vocab = suffix_identity(model)
        core = draft_core_for_command("suffix", None, draft_limits(**limits), client_id, vocab_size=vocab)
        _run_draft(core, tok, MqttLink(hub_url, username=username, password=password, tls=tls), client_id,
                   None, ctl_key, tele=tele)
        return
    engine_kw = check_before_load(role, model, backend, max_len, profile, memory_budget, dtype=dtype,
                                  max_sessions=limits["max_sessions"], max_kv_mb=limits["max_kv_mb"])
    engine, tok = open_model_for_command(model, dtype, threads, max_len, backend, role=role, **engine_kw)
    link = MqttLink(hub_url, username=username, password=password, tls=tls)
    if role == "draft":
        core = draft_core_for_command(drafter, engine, draft_limits(**limits), client_id, min_score=min_score)
        _run_draft(core, tok, link, client_id, None, ctl_key, tele=tele)
    else:
        _run_target(engine, tok, link, client_id, gamma, model, http_host, http_port, prompt, max_new,
                    temperature, tele=tele)


def _run_draft(core, tok, link, service_id, limits=None, ctl_key=None, tele=None) -> None:
    """core: a draft core (edge/star/draft_kinds.py), or an engine for a model DraftService under `limits`."""
    from edge.wire.link import LinkError
    from edge.wire.protocol import draft_hello_topic
    from edge.star.draft_service import DraftService
    from edge.star.draft_node import DraftNode

    if limits is not None:
        core = DraftService(core, limits, name=service_id)
    node = DraftNode(core, link, service_id, tok.fingerprint(), ctl_key=ctl_key)
    link.set_will(draft_hello_topic(service_id), node.will())
    try:
        link.connect(timeout=10)
    except LinkError as e:
        raise click.ClickException(str(e)) from None
    stop = leave_on_sigterm()
    node.start()
    click.echo(f"draft service {service_id} registered at {link.url}; Ctrl-C to leave", err=True)
    telemetry = None
    try:
        if tele:
            telemetry = start_telemetry_for_command(link, service_id, "draft", node.telemetry, **tele)
        _wait_for_signal(stop)
    finally:
        if telemetry is not None:
            telemetry.stop()
        node.stop()
        link.close()
        st = node.service.stats.snapshot()
        click.echo(f"served {st['requests']} requests, busy {st['busy_ratio']:.2f}, "
                   f"mean batch {st['batch_size_mean']:.1f}", err=True)


def _run_sun(role, link, directory, worker_id, task, threads, max_batch, stop_ids, backend,
             ctl_key=None, tele=None, limits=None) -> None:
    from edge.engines.base import EngineError
    from edge.wire.link import LinkError
    from edge.model.sun_error import SunError

    stop = leave_on_sigterm()
    try:
        node = open_node(role, link, directory, worker_id, task=task, threads=threads, max_batch=max_batch,
                         stop_ids=stop_ids, backend="torch" if backend == "auto" else backend, ctl_key=ctl_key,
                         **(limits or {}))
    except (SunError, OSError, EngineError) as e:
        raise click.ClickException(f"--module {directory}: {e}") from None
    except LinkError as e:
        raise click.ClickException(str(e)) from None
    what = f"prefill worker for task {node.worker.task!r}" if role == "prefill" else "shared decoder"
    click.echo(f"{what} {worker_id} up at {link.url}; Ctrl-C to leave", err=True)
    telemetry = None
    try:
        if tele:
            telemetry = start_telemetry_for_command(link, worker_id, role, node.telemetry, **tele)
        _wait_for_signal(stop)
    finally:
        if telemetry is not None:
            telemetry.stop()
        node.stop()
        link.close()
        click.echo(f"{worker_id}: {node.stats}", err=True)


def open_node(role, link, directory, worker_id, task=None, threads=None, max_batch=64, stop_ids=(),
              ctl_key=None, backend="torch", max_sequences=DEFAULT_MAX_SEQUENCES, max_queue=DEFAULT_MAX_QUEUE):
    """The node factory of `edge-agent run --role prefill|decoder`: load the specialist (prefill) or
    the shared decoder (decoder) from its directory, set the node's will on `link`, connect, start."""
    from edge.wire.protocol import sun_hello_topic

    if role == "prefill":
        from edge.sun.prefill import PrefillWorker
        from edge.sun.prefill_node import PrefillNode
        node = PrefillNode(PrefillWorker.from_dir(directory, task=task, threads=threads, backend=backend,
                                                  max_queue=max_queue), link, worker_id, ctl_key=ctl_key)
    elif role == "decoder":
        from edge.sun.decoder import SharedDecoder
        from edge.sun.decoder_node import DecoderNode
        dec = SharedDecoder.from_dir(directory, threads=threads, max_batch=max_batch, stop_ids=stop_ids,
                                     name=worker_id, backend=backend, max_sequences=max_sequences)
        node = DecoderNode(dec, link, worker_id, ctl_key=ctl_key)
    else:
        raise ValueError(f"role must be 'prefill' or 'decoder', got {role!r}")
    link.set_will(sun_hello_topic(worker_id), node.will())
    link.connect(timeout=10)
    return node.start()


def _run_target(engine, tok, link, client_id, gamma, model, host, port, prompt, max_new, temperature,
                tele=None) -> None:
    from edge.star.session import HubClient, JoinRefused
    from edge.star.target import StarTarget
    from edge.spec.sampling import SamplingParams

    gamma, adaptive = gamma                   # STAR_GAMMA: (γ or the largest γ, auto?)
    star = StarTarget(engine, HubClient(link, client_id, tok.fingerprint(), engine.vocab_size), gamma=gamma,
                      adaptive=adaptive)
    try:
        star.check_join()
        click.echo(f"target {client_id} joined the star at {link.url}", err=True)
    except JoinRefused as e:      # no draft now: decode alone, and join when one comes online
        click.echo(f"warning: {e}; decoding alone, joining when the hub can draft", err=True)
    except TimeoutError as e:
        click.echo(f"warning: {e}; decoding alone until the hub answers", err=True)
    telemetry = None
    try:
        if tele:
            telemetry = start_telemetry_for_command(link, client_id, "target", star.telemetry, **tele)
        if prompt is not None:
            ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": prompt}])
                             if tok.chat_template else prompt, add_special=not tok.chat_template)
            stream = tok.decode_stream(skip_special=True)
            res = star.generate(ids, max_new, SamplingParams(temperature=temperature), tuple(tok.eos_ids),
                                on_token=lambda t: (sys.stdout.write(stream.put(t)), sys.stdout.flush()))
            d = star.last_drafter.stats
            click.echo(f"\n{len(res.tokens)} tokens, {res.tokens_per_s:.1f} tok/s, accepted "
                       f"{res.n_accepted}/{res.n_drafted}, answered {d['answered']}/{d['rounds']} rounds",
                       err=True)
            return
        if not port:
            raise click.UsageError("a target needs --http-port (to serve clients) or --prompt")
        from edge.api.openai_http import OpenAIServer

        stop = leave_on_sigterm()
        server = OpenAIServer(star.generate, tok, model_name=str(model), host=host, port=port,
                              context=engine.max_len).start()
        click.echo(f"OpenAI endpoint on http://{host}:{server.port}/v1 (model {model}); Ctrl-C to stop",
                   err=True)
        try:
            _wait_for_signal(stop)
        finally:
            server.stop()
    finally:
        if telemetry is not None:
            telemetry.stop()
        star.hub.close()
        link.close()
