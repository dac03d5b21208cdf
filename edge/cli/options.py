"""Command-line pieces `edge-agent` and `edge-hub` share: the draft service's limits, the
control key, and opening a model with errors a user can act on.

They live here, not in a command module, so that each CLI imports only this
file and no CLI imports another (the hub never imports the agent's commands).
"""
from __future__ import annotations

import signal
import threading
import time

import click

_draft_opts = [
    click.option("--max-sessions", default=64, show_default=True, help="sessions one draft service takes"),
    click.option("--max-kv-mb", default=1024.0, show_default=True,
                 help="KV memory the draft engine holds for all sessions, as it allocates it (torch: "
                      "64-token chunks that double and are kept after a rollback); MB = 10^6 bytes"),
    click.option("--max-gamma", default=16, show_default=True, help="largest γ a session may ask for"),
    click.option("--evict-after", default=60.0, show_default=True, help="seconds of silence before eviction"),
    click.option("--ahead/--no-ahead", default=True, show_default=True,
                 help="draft ahead for recently served sessions while idle"),
    click.option("--coalesce/--no-coalesce", default=True, show_default=True,
                 help="with --no-join: hold a batch a moment for sessions due back when batching has a "
                      "fixed cost (a GPU draft): turns of half-size batches merge; a CPU draft whose "
                      "batch time grows with its size is not held"),
    click.option("--join/--no-join", default=True, show_default=True,
                 help="iteration-level batching: one draft step at a time, a request arriving while a "
                      "batch drafts joins it at the next step instead of waiting for the whole batch "
                      "(past N_full 11-28% more system tok/s on a one-core CPU draft; "
                      "benchmarks/results/starsd_scaling_pinned_xeon_f16_targets_join.md)"),
    click.option("--q-top-k", default=32, show_default=True,
                 help="entries of q sent per drafted token when sampling"),
    click.option("--draft-p-min", default=0.75, show_default=True, type=click.FloatRange(0.0, 1.0, max_open=True),
                 help="end each answer before a position where the draft model's top probability is "
                      "below this (as llama.cpp's --draft-p-min); 0 sends every γ asked for. A γ=auto "
                      "target sends its own with each request (from its verify cost), used where lower"),
]


def draft_options(f):
    """The draft service's limits (`edge-agent run` and `edge-hub serve`)."""
    for opt in reversed(_draft_opts):
        f = opt(f)
    return f


def draft_limits(max_sessions, max_kv_mb, max_gamma, evict_after, ahead, q_top_k, draft_p_min=0.0,
                 coalesce=False, join=False):
    from edge.star.draft_service import DraftLimits
    return DraftLimits(max_sessions=max_sessions, max_kv_mb=max_kv_mb, max_gamma=max_gamma,
                       evict_after_s=evict_after, ahead=ahead, q_top_k=q_top_k, p_min=draft_p_min,
                       coalesce=coalesce, join=join)


def drafter_options(f):
    """Which draft a service runs (`edge-agent run --role draft`, `edge-hub serve`)."""
    f = click.option("--suffix-min-score", default=1.5, show_default=True,
                     help="--drafter hybrid: a suffix proposal whose expected accepted tokens reach this "
                          "(and what the model's answers kept in the session) answers; else the model "
                          "drafts")(f)
    return click.option("--drafter", default="model", show_default=True,
                        type=click.Choice(["model", "suffix", "hybrid"]),
                        help="model: the draft model; suffix: model-free suffix trees over each session and "
                             "the whole fleet's outputs (only the tokenizer of --model/--draft-model is "
                             "loaded); hybrid: the suffix proposal when it scores high, else the model's")(f)


def suffix_identity(spec: str):
    """(tokenizer, vocabulary size) of `spec` without loading its weights: all a suffix draft
    needs to tell the hub which targets it can serve."""
    from edge.model.checkpoint_files import CheckpointError, load_tokenizer
    from edge.engines.base import EngineError
    from edge.memory.model_shape import read_shape
    from edge.model.spec import resolve_model
    try:
        return load_tokenizer(resolve_model(spec)), read_shape(spec).vocab
    except (CheckpointError, EngineError, OSError) as e:
        raise click.ClickException(f"{spec}: {e} (a suffix draft reads the model's tokenizer and "
                                   "vocabulary size: pass the targets' model name or path)") from None


def draft_core_for_command(kind: str, engine, limits, name: str, vocab_size=None, min_score=None):
    """The draft core `--drafter` asks for (edge/star/draft_kinds.py)."""
    from edge.star.draft_kinds import make_draft_core
    try:
        return make_draft_core(kind, engine, limits, name=name, vocab_size=vocab_size, min_score=min_score)
    except ValueError as e:
        raise click.UsageError(str(e)) from None


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


ctl_key_option = click.option("--ctl-key-file", default=None, type=click.Path(dir_okay=False),
                              help="sign control messages with this shared key (the same file on the hub "
                                   "and every draft service / SUN worker)")


def open_model_for_command(spec: str, dtype: str, threads, max_len: int, backend: str = "torch",
                           role=None, **engine_kw):
    """edge.engines.loader.open_model, its errors shown as click errors and the load time reported;
    engine_kw go to the engine (what the memory plan counted, e.g. llama.cpp's n_seq_max)."""
    from edge.model.checkpoint_files import CheckpointError   # torch-free: llama.cpp / ORT roles skip torch
    from edge.engines.base import EngineError       # ModelNotFound is one
    from edge.engines.loader import open_model
    from edge.model.spec import resolve_model

    t0 = time.perf_counter()
    try:
        engine, tok = open_model(spec, backend=backend, role=role, dtype=dtype, threads=threads, max_len=max_len,
                                 **engine_kw)
    except (CheckpointError, EngineError) as e:
        raise click.ClickException(str(e)) from None
    click.echo(f"loaded {resolve_model(spec).name} on {engine.name} (vocab {engine.vocab_size}) "
               f"in {time.perf_counter() - t0:.1f}s", err=True)
    return engine, tok


PASSWORD_ENV = "STARSUN_MQTT_PASSWORD"


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
            raise click.UsageError("--tls-dir needs an mqtts://HOST:PORT --hub")
        return None
    if not tls_dir:
        raise click.UsageError("an mqtts:// --hub needs --tls-dir DIR (ca.crt and this client's "
                               "certificate and key, from `edge-hub certs --device CLIENT_ID`)")
    d = Path(tls_dir)
    for base in (d / "clients", d):
        cert, key = base / f"{client_id}.crt", base / f"{client_id}.key"
        if cert.is_file() and key.is_file() and (d / "ca.crt").is_file():
            return str(d / "ca.crt"), str(cert), str(key)
    raise click.UsageError(f"--tls-dir {tls_dir}: need ca.crt and {client_id}.crt / {client_id}.key "
                           f"(the certificate's CN must be the client id {client_id!r}); make them on the hub "
                           f"with `edge-hub certs --out DIR --device {client_id}`")


AUTO_MAX_GAMMA = 8


class StarGamma(click.ParamType):
    """A StarSD target's --gamma: an integer >= 1 (fixed), `auto` (0..8 per round from measured
    costs, edge/spec/remote_gamma.py) or `auto:N` (0..N). Converts to (gamma, adaptive)."""
    name = "γ|auto[:N]"

    def convert(self, value, param, ctx):
        if isinstance(value, tuple):
            return value
        text = str(value).strip().lower()
        auto, _, top = text.partition(":")
        try:
            if auto == "auto":
                g = int(top) if top else AUTO_MAX_GAMMA
                if g >= 1:
                    return g, True
            elif not top and int(text) >= 1:
                return int(text), False
        except ValueError:
            pass
        self.fail(f"{value!r}: give drafted tokens per round (an integer >= 1), `auto` (γ 0..{AUTO_MAX_GAMMA} "
                  "chosen each round from the acceptance, the verify cost and the round trip) or `auto:N` "
                  "(γ 0..N)", param, ctx)


STAR_GAMMA = StarGamma()


_telemetry_opts = [
    click.option("--telemetry-interval", default=10.0, show_default=True, metavar="SECONDS",
                 type=click.FloatRange(min=0.0),
                 help="publish memory, load, temperature, power and the role's counters, retained, to "
                      "ss/dev/CLIENT_ID/telemetry this often (0: off; `edge-hub top` shows them)"),
    click.option("--metrics-port", default=0, show_default=True, type=click.IntRange(0, 65535),
                 help="serve Prometheus text (starsun_* metrics) on http://HOST:PORT/metrics (0: off)"),
    click.option("--metrics-host", default="127.0.0.1", show_default=True,
                 help="address of the /metrics endpoint (0.0.0.0 for a scraper on another machine)"),
]


def telemetry_options(f):
    """--telemetry-interval / --metrics-port / --metrics-host (`edge-agent run` and `edge-hub serve`)."""
    for opt in reversed(_telemetry_opts):
        f = opt(f)
    return f


def start_telemetry_for_command(link, client_id, role, counters, telemetry_interval, metrics_host, metrics_port,
                                ctl_key=None, board=None):
    """edge.telemetry.publisher.start_telemetry with its errors as click errors; says where /metrics is."""
    from edge.telemetry.publisher import start_telemetry
    try:
        svc = start_telemetry(link, client_id, role, counters, telemetry_interval, metrics_host, metrics_port,
                              ctl_key=ctl_key, board=board)
    except OSError as e:
        raise click.ClickException(f"--metrics-port {metrics_port}: cannot listen on {metrics_host}: {e.strerror}; "
                                   "pick a free port or 0 (off)") from None
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
