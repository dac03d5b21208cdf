"""The roles `edge-agent run` starts (edge/cli/agent_run.py builds what each needs): a draft
service, a SUN prefill worker or shared decoder, a target. Each connects, says where it is,
publishes its telemetry and runs until SIGINT / SIGTERM, then leaves cleanly and prints its stats.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import click

from edge.cli.role_endpoint import generate_once, prompt_or_serve, serve_until_signal, telemetry_running
from edge.cli.startup import TelemetrySettings, leave_on_sigterm, wait_for_signal
from edge.sun.worker_limits import DEFAULT_MAX_QUEUE, DEFAULT_MAX_SEQUENCES


@dataclass
class TargetSettings:
    """A target's γ and how it serves: --gamma, --http-host/--http-port, or --prompt once; the KV of
    recent conversations it keeps: --prompt-cache N, --prompt-cache-mb, --prompt-cache-ram; requests at once: --parallel N,
    --queue N more waiting (edge/api/admission.py)."""
    gamma: int                      # the fixed γ, or the largest with adaptive
    adaptive: bool                  # --gamma auto[:N]
    http_host: str
    http_port: int
    prompt: Optional[str]
    max_new: int
    temperature: float
    hubs: tuple = ()                # --hub-ids: the star's hub ids when there are several
    prompt_cache: int = 0           # --prompt-cache: conversations kept (edge/speculative/prefix_cache.py)
    prompt_cache_mb: float = 1024.0  # --prompt-cache-mb: their KV bound
    prompt_cache_ram: Optional[float] = 0.0   # --prompt-cache-ram: MB of evicted ones saved to host memory (None: default)
    parallel: int = 1               # --parallel: generations at once, their engine calls batched
    queue: int = 16                 # --queue: requests waiting beyond them (then 503)


def run_draft(core, tok, link, service_id, ctl_key=None, tele: Optional[TelemetrySettings] = None) -> None:
    """core: a draft core of any kind (edge/cli/startup.py build_draft)."""
    from edge.wire.link import LinkError
    from edge.wire.protocol import draft_hello_topic
    from edge.star.draft_node import DraftNode

    node = DraftNode(core, link, service_id, tok.fingerprint(), ctl_key=ctl_key)
    link.set_will(draft_hello_topic(service_id), node.will())
    try:
        link.connect(timeout=10)
    except LinkError as e:
        raise click.ClickException(str(e)) from None
    stop = leave_on_sigterm()
    node.start()
    click.echo(f"draft service {service_id} registered at {link.url}; Ctrl-C to leave", err=True)
    try:
        with telemetry_running(link, service_id, "draft", node.telemetry, tele, ctl_key):
            wait_for_signal(stop)
    finally:
        node.stop()
        link.close()
        st = node.service.stats.snapshot()
        click.echo(f"served {st['requests']} requests, busy {st['busy_ratio']:.2f}, "
                   f"mean batch {st['batch_size_mean']:.1f}", err=True)


def run_sun(role, link, directory, worker_id, sun, threads, backend, ctl_key=None,
            tele: Optional[TelemetrySettings] = None, engine_kw=None) -> None:
    """sun: the worker's SunSettings (task, max_batch, max_sequences, max_queue, stop_ids); engine_kw:
    where its engine runs (Placement.engine_kwargs())."""
    from edge.engines.base import EngineError
    from edge.wire.link import LinkError
    from edge.model.sun_error import SunError

    stop = leave_on_sigterm()
    try:
        node = open_node(role, link, directory, worker_id, task=sun.task, threads=threads, max_batch=sun.max_batch,
                         stop_ids=sun.stop_ids, backend=backend, ctl_key=ctl_key,
                         max_sequences=sun.max_sequences, max_queue=sun.max_queue, engine_kw=engine_kw,
                         adapters=sun.adapters, tokenizer=sun.tokenizer)
    except (SunError, OSError, EngineError) as e:
        raise click.ClickException(f"--module {directory}: {e}") from None
    except LinkError as e:
        raise click.ClickException(str(e)) from None
    what = "shared decoder"
    if role == "prefill":
        tasks = node.worker.tasks
        what = f"prefill worker for task{'s' if len(tasks) > 1 else ''} {', '.join(tasks)}"
        for task, why in getattr(node.worker, "refused", {}).items():
            click.echo(f"adapter for task {task!r} refused: {why}", err=True)
    click.echo(f"{what} {worker_id} up at {link.url}; Ctrl-C to leave", err=True)
    try:
        with telemetry_running(link, worker_id, role, node.telemetry, tele, ctl_key):
            wait_for_signal(stop)
    finally:
        node.stop()
        link.close()
        click.echo(f"{worker_id}: {node.stats}", err=True)


def open_node(role, link, directory, worker_id, task=None, threads=None, max_batch=64, stop_ids=(),
              ctl_key=None, backend="torch", max_sequences=DEFAULT_MAX_SEQUENCES, max_queue=DEFAULT_MAX_QUEUE,
              engine_kw=None, adapters=(), tokenizer=None):
    """The node factory of `edge-agent run --role prefill|decoder`: load the specialist (prefill) or
    the shared decoder (decoder) from its directory, set the node's will on `link`, connect, start.
    engine_kw: where its engine runs (Placement.engine_kwargs()). adapters: (task, path) pairs: a
    prefill worker over the base in `directory` with a LoRA adapter per task (so too a bundle
    listing adapters), serving every task (edge/sun/adapter_prefill.py). tokenizer: the base model's,
    for request grammars (edge/sun/worker_tokenizer.py; None: a bundle's own, if any)."""
    from edge.sun.worker_tokenizer import worker_grammars
    from edge.wire.protocol import sun_hello_topic

    if role == "prefill":
        from edge.sun.adapter_prefill import AdapterPrefillWorker, listed_tasks
        from edge.sun.prefill import PrefillWorker
        from edge.sun.prefill_node import PrefillNode
        if adapters or listed_tasks(directory):
            worker = AdapterPrefillWorker.open(directory, adapters, backend=backend, threads=threads,
                                               max_queue=max_queue, engine_kw=engine_kw, name=worker_id)
        else:
            worker = PrefillWorker.from_dir(directory, task=task, threads=threads, backend=backend,
                                            max_queue=max_queue, engine_kw=engine_kw)
        engine = worker.engine
        worker.grammars = worker_grammars(directory, tokenizer, engine.vocab_size)
        node = PrefillNode(worker, link, worker_id, ctl_key=ctl_key)
    elif role == "decoder":
        from edge.sun.decoder import SharedDecoder
        from edge.sun.decoder_node import DecoderNode
        dec = SharedDecoder.from_dir(directory, threads=threads, max_batch=max_batch, stop_ids=stop_ids,
                                     name=worker_id, backend=backend, max_sequences=max_sequences,
                                     engine_kw=engine_kw)
        engine = dec.engine
        dec.grammars = worker_grammars(directory, tokenizer, engine.vocab_size)
        node = DecoderNode(dec, link, worker_id, ctl_key=ctl_key)
    else:
        raise ValueError(f"role must be 'prefill' or 'decoder', got {role!r}")
    click.echo(f"loaded {directory} on {engine.name}: {engine.where()}; request grammars "
               f"{'followed' if (node.worker if role == 'prefill' else node.decoder).grammars else 'refused (no --tokenizer)'}",
               err=True)
    link.set_will(sun_hello_topic(worker_id), node.will())
    link.connect(timeout=10)
    return node.start()


def run_target(engine, tok, link, client_id, model, target: TargetSettings,
               tele: Optional[TelemetrySettings] = None, ctl_key=None) -> None:
    """Join the star (or decode alone until a draft comes online), then --prompt once or serve."""
    from edge.cli.options import open_prompt_cache
    from edge.engines.batched_calls import shared_engine
    from edge.star.hub_client import HubClient, JoinRefused
    from edge.star.target import StarTarget

    engine = shared_engine(engine, target.parallel)     # concurrent generations: one batched call a round

    star = StarTarget(engine, HubClient(link, client_id, tok.fingerprint(), engine.vocab_size, hubs=target.hubs),
                      gamma=target.gamma, adaptive=target.adaptive,
                      prefix_cache=open_prompt_cache(engine, target.prompt_cache, target.prompt_cache_mb,
                                                     target.prompt_cache_ram),
                      keep_sessions=target.parallel)     # one kept hub session per conversation served at once
    try:
        star.check_join()
        click.echo(f"target {client_id} joined the star at {link.url}", err=True)
    except JoinRefused as e:      # no draft now: decode alone, and join when one comes online
        click.echo(f"warning: {e}; decoding alone, joining when the hub can draft", err=True)
    except TimeoutError as e:
        click.echo(f"warning: {e}; decoding alone until the hub answers", err=True)
    try:
        with telemetry_running(link, client_id, "target", star.telemetry, tele, ctl_key):
            prompt_or_serve(target, "target", lambda: _generate_once(star, tok, target),
                            lambda: serve_until_signal(star.generate, tok, engine, model, target, f"model {model}"))
    finally:
        star.hub.close()
        link.close()


def _generate_once(star, tok, target: TargetSettings) -> None:
    res = generate_once(star.generate, tok, target)
    d = star.last_drafter.stats
    click.echo(f"\n{len(res.tokens)} tokens, {res.tokens_per_s:.1f} tok/s, accepted "
               f"{res.n_accepted}/{res.n_drafted}, answered {d.answered}/{d.rounds} rounds", err=True)
