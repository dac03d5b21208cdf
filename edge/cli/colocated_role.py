"""`edge-agent run --role prefill --with-decoder`: a prefill worker with adapters and the shared decoder
in ONE process over one copy of the base (edge/sun/colocated.py).

On one machine the two SUN roles otherwise load the base twice (a prefill worker's and a decoder's);
here the decoder runs on a second context of the prefill worker's model (llama.cpp) or over the same
tensors (torch), and the KV of a job the router gives to it is handed over in memory. Both nodes join
the star as ordinary workers: the prefill worker as --client-id, the decoder as CLIENT_ID-decoder.
With broker credentials (the hub's per-user ACL lets a user announce only its own id) that needs a
second user, so it is refused there: run `--role decoder` as its own process.
"""
from __future__ import annotations

import click

from dataclasses import replace

from edge.cli.startup import leave_on_sigterm, start_telemetry_for_command, wait_for_signal


def decoder_id_of(worker_id: str) -> str:
    return f"{worker_id}-decoder"


def open_colocated(broker, directory, worker_id, sun, threads, backend, ctl_key=None, engine_kw=None):
    """(prefill node, decoder node), connected and started; sun: the agent's SunSettings (its
    max_batch / max_sequences / stop_ids are the decoder's, max_queue the prefill worker's)."""
    from edge.engines.free_heap import give_back_free_heap
    from edge.sun.adapter_prefill import AdapterPrefillWorker
    from edge.sun.colocated import nodes_over_worker
    from edge.sun.worker_tokenizer import worker_grammars
    # llama.cpp prefills a step's rows one after another (no shared call): a step of one row batches
    # nothing less, hands its KV to the decoder as soon as it is made (not after the step's last row)
    # and holds one sequence of prefill KV instead of eight; the decoder's context is made before the
    # adapters load (edge/sun/adapter_llamacpp.py: llama.cpp sizes a context by every adapter loaded)
    rows = {"max_rows": 1, "decode_batch": sun.max_batch} if backend == "llamacpp" else {}
    worker = AdapterPrefillWorker.open(directory, sun.adapters, backend=backend, threads=threads,
                                       max_queue=sun.max_queue, engine_kw=engine_kw, name=worker_id, **rows)
    worker.grammars = worker_grammars(directory, sun.tokenizer, worker.engine.vocab_size, sun.grammars_on_demand)
    give_back_free_heap()                  # what loading freed (edge/engines/free_heap.py)
    dec_id = decoder_id_of(worker_id)
    pre_link, dec_link = broker.link(client_id=worker_id), broker.link(client_id=dec_id)
    pre, dec = nodes_over_worker(worker, pre_link, dec_link, worker_id, dec_id, ctl_key, sun.max_batch,
                                 decoder_kw={"stop_ids": sun.stop_ids, "max_sequences": sun.max_sequences})
    click.echo(f"loaded {directory} on {worker.engine.name}: {worker.engine.where()}; the decoder "
               f"{dec_id} on {dec.decoder.engine.where()}; request grammars "
               f"{_grammars_said(worker.grammars, sun.grammars_on_demand)}", err=True)
    dec_link.connect(timeout=10)
    dec.start()                            # the decoder first: the prefill worker's jobs go to it
    pre_link.connect(timeout=10)
    pre.start()
    return pre, dec


def _grammars_said(grammars, on_demand: bool) -> str:
    if not grammars:
        return "refused (no --tokenizer)"
    return "followed (the tokenizer loads at the first one)" if on_demand else "followed"


def run_colocated(broker, directory, worker_id, sun, threads, backend, ctl_key=None, tele=None,
                  engine_kw=None) -> None:
    """Serve until SIGINT / SIGTERM, then leave (both nodes) and print their stats."""
    from edge.engines.base import EngineError
    from edge.model.sun_error import SunError
    from edge.wire.link import LinkError

    if broker.password or broker.tls:
        raise click.UsageError("--with-decoder joins the star under two ids (the prefill worker and "
                               f"{decoder_id_of(worker_id)}); the broker's per-user ACL lets one user announce only "
                               "its own: without credentials only, or run --role decoder as its own process")
    stop = leave_on_sigterm()
    try:
        pre, dec = open_colocated(broker, directory, worker_id, sun, threads, backend, ctl_key, engine_kw)
    except (SunError, OSError, EngineError) as e:
        raise click.ClickException(f"--module {directory}: {e}") from None
    except LinkError as e:
        raise click.ClickException(str(e)) from None
    for task, why in pre.worker.refused.items():
        click.echo(f"adapter for task {task!r} refused: {why}", err=True)
    tasks = pre.worker.tasks
    click.echo(f"prefill worker for task{'s' if len(tasks) > 1 else ''} {', '.join(tasks)} {worker_id} and shared "
               f"decoder {dec.id} (one copy of the base) up at {pre.link.url}; Ctrl-C to leave", err=True)
    telemetry = []
    try:
        if tele:
            # one /metrics port: the prefill worker's; the decoder publishes its reports only
            telemetry = [start_telemetry_for_command(pre.link, pre.id, "prefill", pre.telemetry, tele, ctl_key),
                         start_telemetry_for_command(dec.link, dec.id, "decoder", dec.telemetry,
                                                     replace(tele, metrics_port=0), ctl_key)]
            telemetry = [t for t in telemetry if t is not None]
        wait_for_signal(stop)
    finally:
        for t in telemetry:
            t.stop()
        pre.stop()
        dec.stop()
        pre.link.close()
        dec.link.close()
        dec.decoder.engine.close()      # llama.cpp: the second context before the model it uses
        click.echo(f"{worker_id}: {pre.stats}; {dec.id}: {dec.stats}", err=True)
