"""What `edge-agent run` and `edge-hub serve` do with their options as they start: open a model,
build a draft core of any `--drafter` kind, start telemetry, and leave cleanly on a signal.

Each turns the library's errors into click errors that say what to do, so a command body
never shows a traceback for a user's mistake.
"""
from __future__ import annotations

import signal
import threading
import time
from dataclasses import dataclass
from typing import Callable, Optional

import click


def resolve_for_command(ref, backend: str = "auto", role=None, role_of: Optional[Callable] = None):
    """The ResolvedModel of what a command was told (edge/model/resolved.py: the one place a name
    or path is resolved and `auto` chosen), its errors as click errors that say what to do.
    role_of(model) -> role: a role that depends on what the model is (a prefill worker over a
    bundle's adapters runs the decoder's artifact)."""
    from edge.engines.base import EngineError       # ModelNotFound and BundleError are ones
    from edge.model.resolved import identify
    try:
        m = identify(ref)
        return m.choose(backend, role_of(m) if role_of else role)
    except EngineError as e:
        raise click.ClickException(str(e)) from None


def open_model_for_command(model, dtype: str, threads, max_len: int, device: str = "auto", gpu_layers=None,
                           profile: Optional[str] = None, placement=None, repack: str = "auto",
                           exact_rows: bool = False, **engine_kw):
    """edge.engines.loader.open_model of a ResolvedModel, its errors shown as click errors and the
    load time reported; engine_kw go to the engine (what the memory plan counted, e.g. llama.cpp's
    n_seq_max). Where it runs: `placement` if decided already, else decided here from device /
    gpu_layers / profile / repack (edge/cli/placing.py); the loaded line ends with where the engine put it
    (llama.cpp: and whether it repacked the weights, and why)."""
    from edge.cli.placing import place_model
    from edge.model.checkpoint_files import CheckpointError   # torch-free: llama.cpp / ORT roles skip torch
    from edge.engines.base import EngineError       # ModelNotFound is one
    from edge.engines.loader import open_model

    if placement is None:
        placement = place_model(model, device, gpu_layers, profile, repack=repack, exact_rows=exact_rows)
    engine_kw = {**engine_kw, **placement.engine_kwargs()}
    t0 = time.perf_counter()
    try:
        engine, tok = open_model(model, dtype=dtype, threads=threads, max_len=max_len, **engine_kw)
    except (CheckpointError, EngineError) as e:
        raise click.ClickException(str(e)) from None
    click.echo(f"loaded {model.path.name} on {engine.name} (vocab {engine.vocab_size}) "
               f"in {time.perf_counter() - t0:.1f}s: {engine.where()}", err=True)
    return engine, tok


def suffix_identity(model):
    """(tokenizer, vocabulary size) of a ResolvedModel without loading its weights: all a suffix
    draft needs to tell the hub which targets it can serve."""
    from edge.model.checkpoint_files import CheckpointError
    from edge.engines.base import EngineError
    from edge.engines.loader import open_tokenizer
    try:
        return open_tokenizer(model), model.shape.vocab
    except (CheckpointError, EngineError, OSError) as e:
        raise click.ClickException(f"{model.ref}: {e} (a suffix draft reads the model's tokenizer and "
                                   "vocabulary size: pass the targets' model name or path)") from None


@dataclass
class DraftSetup:
    """What a draft service runs: `kind` (--drafter) over the model `model`, under `limits`."""
    kind: str                       # model | suffix | hybrid (edge/star/draft_kinds.py)
    model: object                   # its ResolvedModel (or, suffix, the one whose tokenizer it serves);
                                    # the name or path as given until the command resolves it
    limits: object                  # DraftLimits
    min_score: Optional[float] = None   # hybrid: --suffix-min-score


def build_draft(plan: DraftSetup, name: str, load_model: Callable[[], tuple]):
    """(draft core, tokenizer) for any --drafter kind: the one path of `edge-hub serve`'s own draft
    and `edge-agent run --role draft`. A suffix draft reads only the tokenizer; the others call
    load_model() -> (engine, tokenizer), which each command opens its own way."""
    from edge.star.draft_kinds import make_draft_core
    engine, vocab = None, None
    if plan.kind == "suffix":       # no weights: the tokenizer says whom it serves
        tok, vocab = suffix_identity(plan.model)
    else:
        engine, tok = load_model()
    try:
        core = make_draft_core(plan.kind, engine, plan.limits, name=name, vocab_size=vocab,
                               min_score=plan.min_score, grammar_tokenizer=_grammars_of(tok, engine))
    except ValueError as e:
        raise click.UsageError(str(e)) from None
    return core, tok


def _grammars_of(tok, engine):
    """The draft's tokenizer for grammars (constrained output), made at the first grammar asked for."""
    if engine is None or tok is None:
        return None
    from edge.speculative.grammar import grammar_tokenizer
    return lambda: grammar_tokenizer(tok, engine.vocab_size)


@dataclass
class TelemetrySettings:
    """--telemetry-interval / --metrics-host / --metrics-port."""
    telemetry_interval: float = 10.0
    metrics_host: str = "127.0.0.1"
    metrics_port: int = 0

    @classmethod
    def from_options(cls, options: dict) -> "TelemetrySettings":
        return cls(options["telemetry_interval"], options["metrics_host"], options["metrics_port"])


def start_telemetry_for_command(link, client_id, role, counters, settings: TelemetrySettings, ctl_key=None,
                                board=None):
    """edge.telemetry.publisher.start_telemetry with its errors as click errors; says where /metrics is."""
    from edge.telemetry.publisher import start_telemetry
    s = settings
    try:
        svc = start_telemetry(link, client_id, role, counters, s.telemetry_interval, s.metrics_host, s.metrics_port,
                              ctl_key=ctl_key, board=board)
    except OSError as e:
        raise click.ClickException(f"--metrics-port {s.metrics_port}: cannot listen on {s.metrics_host}: "
                                   f"{e.strerror}; pick a free port or 0 (off)") from None
    if svc is not None and svc.metrics is not None:
        click.echo(f"metrics on {svc.metrics.url}", err=True)
    return svc


def leave_on_sigterm() -> threading.Event:
    """From now on SIGTERM asks the node (or hub) to leave cleanly: an event it waits on. Installed
    before a node starts: one that others already use (its hello is out) must not die of a SIGTERM
    that comes before it waits (a test saw it killed by signal 15 there, on a busy machine)."""
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    return stop


def wait_for_signal(stop: threading.Event, every: float = 3600, tick: Optional[Callable[[], None]] = None) -> None:
    """Until SIGINT or SIGTERM (leave_on_sigterm) sets `stop`, calling tick() every `every` seconds.
    SIGINT only from here: Ctrl-C while a model loads still interrupts at once."""
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    while not stop.wait(every):
        if tick is not None:
            tick()
