"""Every option `edge-agent` and `edge-hub` share, declared once, and the readers of their values.

Each decorator below adds options to a command under their --help section (edge/cli/sections.py):
the model (dtype, threads, context, backend), γ, the draft
service's limits and kind, the SUN decoder's stop ids, telemetry. The readers turn option values
into what a role needs (DraftLimits, a prompt cache) with errors that say what to do. The broker
and its credentials: edge/cli/broker_options.py.

They live here, not in a command module, so that each CLI imports only this file and no CLI
imports another (the hub never imports the agent's commands).
"""
from __future__ import annotations

import logging
from typing import Optional

import click

from edge.cli.sections import DRAFT, MODEL, SUN, TELEMETRY, Section, option

DTYPES = click.Choice(["float32", "float64", "bfloat16", "float16"])
BACKENDS = click.Choice(["torch", "onnx", "llamacpp", "auto"])
DRAFT_KINDS = click.Choice(["model", "suffix", "hybrid"])      # edge/star/draft_kinds.py
AUTO_MAX_GAMMA = 8


def apply(f, decorators):
    """`f` decorated by each of `decorators`, the first one listed first in --help."""
    for d in reversed(decorators):
        f = d(f)
    return f


# ---- the model ----

def backend_option(*names, default="torch", section: Section = MODEL, help="engine"):
    """A backend choice (--backend of the agent's commands, --draft-backend, --sun-backend)."""
    return option(section, *(names or ("--backend", "-b")), default=default, show_default=default is not None,
                  type=BACKENDS, help=help)


dtype_option = option(MODEL, "--dtype", default="float32", type=DTYPES, show_default=True,
                      help="torch: the weights' dtype (bfloat16 / float16 on a GPU; onnx / llama.cpp take their "
                           "file's)")


def threads_option(f):
    return option(MODEL, "--threads", default=None, type=int,
                  help="threads a model computes with. torch: for large calls (default: 1 on <= 4 cores; calls "
                       "over <= 5 rows always use 1); llama.cpp: default one per physical core the process may "
                       "run on, as llama-server")(f)


REPACK_HELP = ("llamacpp: repack the weights kept on the CPU into llama.cpp's interleaved layouts (llama-server's "
               "default). auto: only where every weight type is F32, F16, BF16, Q4_0, Q4_1 or Q8_0, so a Q4_K "
               "file is not repacked (on x86 it prefills faster unrepacked: a 1.5B Q4_K_M ~1.5x); on: repack "
               "anyway (K-quants decode faster, ~15% on the 1.5B); off: never; both: repacked, and prompts of 64+ "
               "tokens prefill on an unrepacked copy of the weights (each side's speed, ~2x the weight memory). A "
               "llama.cpp built with the AMX backend never repacks (it would crash)")


def repack_option(f):
    """--repack auto|on|off|both: llama.cpp's CPU weight repacking (edge/engines/llamacpp_repack.py)."""
    return option(MODEL, "--repack", default="auto", show_default=True, type=click.Choice(["auto", "on", "off", "both"]),
                  help=REPACK_HELP)(f)


def exact_rows_option(f):
    """--exact-rows: pad a target's llama.cpp calls so that its rows round alike (llamacpp_rows.py)."""
    return option(MODEL, "--exact-rows/--fast-rows", default=False, show_default=True,
                  help="llamacpp: pad every call so that a row rounds the same whatever call computes it (a "
                       "one-row decode, a verify, a batch of several requests; any thread count, repacked or "
                       "not): a target's speculative greedy text is then its plain greedy text bit for bit. "
                       "It costs the padding: a lone decode step computes 8 rows, a verify of 5 rows 8. Without "
                       "it llama.cpp rounds rows by the call's shape, as llama-server does; a draft needs no "
                       "exactness (the target verifies it)")(f)


def placement_options(f):
    """--accelerator / --gpu-layers / --repack: where a model runs (edge/engines/placement.py decides
    `auto`) and how llama.cpp lays out the weights it keeps on the CPU."""
    return apply(f, [
        option(MODEL, "--accelerator", "device", default="auto", show_default=True, type=click.Choice(["auto", "cpu", "cuda"]),
               help="where the model runs. auto: the GPU where the backend's runtime can use one (llama.cpp "
                    "built with CUDA, onnxruntime-gpu, CUDA torch) and the --profile has a GPU, else the CPU; "
                    "cuda: the GPU or a refusal naming what to install"),
        option(MODEL, "--gpu-layers", default=None, metavar="N|all",
               help="llamacpp: layers on the GPU (all, or N of them; 0: none); other backends place the whole "
                    "model by --accelerator"),
        repack_option,
        exact_rows_option,
        renamed_option("--device", "--accelerator auto|cpu|cuda"),
    ])


def model_options(f):
    """--dtype / --threads / --max-len and the placement (--accelerator / --gpu-layers / --repack) of a
    loaded model (`edge-agent run|generate`, `edge-hub serve`: its draft, verify target and SUN decoder)."""
    return apply(f, [dtype_option, threads_option,
                     option(MODEL, "--max-len", default=4096, show_default=True, help="context cap per sequence"),
                     placement_options])


# ---- γ ----

class StarGamma(click.ParamType):
    """--gamma: an integer >= 1 (fixed), `auto` (0..8 per round from measured costs,
    edge/speculative/remote_gamma.py, edge/speculative/adaptive.py) or `auto:N` (0..N). Converts to
    (gamma, adaptive): the fixed γ or the largest γ, and whether a policy picks it."""
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


def gamma_option(section: Section, what: str = "drafted tokens per verification"):
    """--gamma / -g N|auto[:N] (`edge-agent run`, `edge-agent generate`, `edge-hub demo`)."""
    return option(section, "--gamma", "-g", default="4", show_default=True, type=STAR_GAMMA,
                  metavar="γ|auto[:N]",
                  help=f"{what}, or `auto` (0..{AUTO_MAX_GAMMA} each round from the acceptance and the measured "
                       "costs; `auto:N` for 0..N)")


class HubList(click.ParamType):
    """--hub-ids a,b (or a TOML list): the star's hub ids when there are several (edge/star/hub_ring.py)."""
    name = "hub ids"

    def convert(self, value, param, ctx):
        from edge.star.hub_ring import parse_hub_list
        if isinstance(value, tuple):
            return value
        try:
            return tuple(parse_hub_list(value))
        except ValueError as e:
            self.fail(str(e), param, ctx)


def hubs_option(section: Section, who: str):
    """--hub-ids ID,ID,...: several hubs on one broker (`edge-hub serve`, `edge-agent run`)."""
    real = option(section, "--hub-ids", "hubs", default=(), type=HubList(), metavar="ID,ID,...",
                  help=f"every hub's id when the star has several ({who}); each client is served by "
                       "one of the live ones, and moves when it dies (docs/star.md, Several hubs)")
    return lambda f: renamed_option("--hubs", "--hub-ids ID,ID,...")(real(f))


def _no_adaptive(ctx, param, value):
    if value:
        raise click.UsageError("--adaptive is gone: write --gamma auto (γ 0..8 chosen each round) or "
                               "--gamma auto:N (0..N; `--gamma 4 --adaptive` is --gamma auto:4)")


# the old spelling of γ=auto on `edge-agent generate`: refused with the new one
adaptive_refusal = click.option("--adaptive", is_flag=True, hidden=True, expose_value=False, callback=_no_adaptive)


# ---- a target's prompt cache ----

def prompt_cache_options(section: Section):
    """--prompt-cache N / --prompt-cache-mb MB / --prompt-cache-ram MB: the KV of recent conversations a
    target keeps, on the engine and saved to host memory (edge/speculative/prefix_cache.py,
    saved_prompts.py; `edge-agent run`, `edge-agent generate`, `edge-agent plan`)."""
    from edge.speculative.prefix_cache import DEFAULT_MB, DEFAULT_SLOTS
    from edge.speculative.saved_prompts import DEFAULT_RAM_MB
    return lambda f: apply(f, [
        option(section, "--prompt-cache", default=DEFAULT_SLOTS, show_default=True, type=click.IntRange(0, 64),
               metavar="N", help="conversations whose KV the target keeps between requests: a request sharing a "
                                 "prefix with one (a chat's next turn) prefills only the rest (0: off; on "
                                 "llama.cpp each is one more sequence of --max-len, allocated at start)"),
        option(section, "--prompt-cache-mb", default=DEFAULT_MB, show_default=True, metavar="MB",
               type=click.FloatRange(min=0.0),
               help="the most KV those conversations hold, as the engine allocates it (the least recently "
                    "used goes first); MB = 10^6 bytes"),
        option(section, "--prompt-cache-ram", default=None, metavar="MB", type=click.FloatRange(min=0.0),
               help="the most KV of conversations evicted from those N saved to host memory and restored "
                    "(a copy, milliseconds) when a request continues one, as llama-server's --cache-ram "
                    f"(0: off; default {DEFAULT_RAM_MB:.0f}, or what --profile / --memory-budget leave if "
                    "less; counted by `edge-agent plan`)"),
    ])


def parallel_options(section: Section, queue: bool = True):
    """--parallel N / --queue N: requests a target generates at once, and how many more wait
    (edge/api/admission.py; `edge-agent run` and `edge-agent plan`, which counts N sequences)."""
    from edge.api.admission import DEFAULT_PARALLEL, DEFAULT_QUEUE
    opts = [
        option(section, "--parallel", default=DEFAULT_PARALLEL, show_default=True, type=click.IntRange(1, 64),
               metavar="N", help="requests the target generates at once: their verify calls go to the engine "
                                 "as one batched call per round, each drafts on its own hub session (on "
                                 "llama.cpp each is one more sequence of --max-len, allocated at start)"),
        option(section, "--queue", default=DEFAULT_QUEUE, show_default=True, type=click.IntRange(0, 4096),
               metavar="N", help="requests waiting beyond --parallel; past them a request is answered 503 "
                                 "with Retry-After"),
    ]
    return lambda f: apply(f, opts if queue else opts[:1])


def open_prompt_cache(engine, slots: int, mb: float, ram_mb: Optional[float] = 0.0):
    """The PrefixCache of --prompt-cache / --prompt-cache-mb / --prompt-cache-ram on `engine` (None when
    off). A llama.cpp engine learns first when a next turn's short prefill pays a 64-row tile
    (tile_calibration.py)."""
    if not slots:
        return None
    from edge.engines.tile_calibration import calibrate_tiles
    from edge.speculative.prefix_cache import PrefixCache
    calibrate_tiles(engine, say=lambda msg: click.echo(msg, err=True))
    from edge.speculative.saved_prompts import DEFAULT_RAM_MB
    ram = DEFAULT_RAM_MB if ram_mb is None else ram_mb                 # None: the default (no budget to fit)
    cache = PrefixCache(engine, int(slots), int(mb * 1e6), ram_bytes=int(ram * 1e6))
    if cache.saved is not None:
        click.echo(f"prompt cache: {slots} conversations on the engine, up to {ram:.0f} MB more saved to host "
                   "memory (--prompt-cache-ram)", err=True)
    return cache


# ---- the draft service ----

def draft_options(f):
    """The draft service's limits (`edge-agent run --role draft` and `edge-hub serve`)."""
    return apply(f, [
        option(DRAFT, "--max-sessions", default=64, show_default=True, help="sessions one draft service takes"),
        option(DRAFT, "--max-kv-mb", default=1024.0, show_default=True,
               help="KV memory the draft engine holds for all sessions, as it allocates it (torch: 64-token "
                    "chunks that double and are kept after a rollback); MB = 10^6 bytes"),
        option(DRAFT, "--max-gamma", default=16, show_default=True, help="largest γ a session may ask for"),
        option(DRAFT, "--evict-after", default=60.0, show_default=True, help="seconds of silence before eviction"),
        option(DRAFT, "--ahead/--no-ahead", default=True, show_default=True,
               help="draft ahead for recently served sessions while idle"),
        option(DRAFT, "--coalesce/--no-coalesce", default=True, show_default=True,
               help="with --no-join: hold a batch a moment for sessions due back when batching has a fixed "
                    "cost (a GPU draft): turns of half-size batches merge; a CPU draft whose batch time grows "
                    "with its size is not held"),
        option(DRAFT, "--join/--no-join", default=True, show_default=True,
               help="iteration-level batching: one draft step at a time, a request arriving while a batch "
                    "drafts joins it at the next step instead of waiting for the whole batch (past N_full "
                    "11-28% more system tok/s on a one-core CPU draft; "
                    "benchmarks/results/starsd_scaling/pinned_xeon_f16_targets_join.md)"),
        option(DRAFT, "--q-top-k", default=32, show_default=True,
               help="entries of q sent per drafted token when sampling"),
        option(DRAFT, "--draft-p-min", default=0.75, show_default=True,
               type=click.FloatRange(0.0, 1.0, max_open=True),
               help="end each answer before a position where the draft model's top probability is below this "
                    "(as llama.cpp's --draft-p-min); 0 sends every γ asked for. A γ=auto target sends its own "
                    "with each request (from its verify cost), used where lower"),
        option(DRAFT, "--drafter", default="model", show_default=True, type=DRAFT_KINDS,
               help="model: the draft model; suffix: model-free suffix trees over each session and the whole "
                    "fleet's outputs (only the model's tokenizer is loaded); hybrid: the suffix proposal when "
                    "it scores high, else the model's"),
        option(DRAFT, "--suffix-min-score", default=1.5, show_default=True,
               help="--drafter hybrid: a suffix proposal whose expected accepted tokens reach this (and what "
                    "the model's answers kept in the session) answers; else the model drafts"),
    ])


def draft_limits(options: dict):
    """The DraftLimits of draft_options' values (a command's options by parameter name)."""
    from edge.star.draft_service import DraftLimits
    o = options
    return DraftLimits(max_sessions=o["max_sessions"], max_kv_mb=o["max_kv_mb"], max_gamma=o["max_gamma"],
                       evict_after_s=o["evict_after"], ahead=o["ahead"], q_top_k=o["q_top_k"],
                       p_min=o["draft_p_min"], coalesce=o["coalesce"], join=o["join"])


# ---- SUN and telemetry ----

def stop_ids_option(what: str):
    return option(SUN, "--stop-id", "stop_ids", multiple=True, type=int,
                  help=f"{what}: extra end-of-sequence token ids (repeatable)")


def telemetry_options(f):
    """--telemetry-interval / --metrics-port / --metrics-host (`edge-agent run` and `edge-hub serve`)."""
    return apply(f, [
        option(TELEMETRY, "--telemetry-interval", default=10.0, show_default=True, metavar="SECONDS",
               type=click.FloatRange(min=0.0),
               help="publish memory, load, temperature, power and the role's counters, retained, to "
                    "ss/dev/CLIENT_ID/telemetry this often (0: off; `edge-hub top` shows them)"),
        option(TELEMETRY, "--metrics-port", default=0, show_default=True, type=click.IntRange(0, 65535),
               help="serve Prometheus text (starsun_* metrics) on http://HOST:PORT/metrics (0: off)"),
        option(TELEMETRY, "--metrics-host", default="127.0.0.1", show_default=True,
               help="address of the /metrics endpoint (0.0.0.0 for a scraper on another machine)"),
    ])



# ---- one spelling per meaning ----

def renamed_option(old: str, new: str, why: str = ""):
    """A spelling that is gone: hidden from --help, it fails naming the option that replaced it."""
    def fail(ctx, param, value):
        if value:
            raise click.UsageError(f"{old} is gone: write {new}{why}")
    return click.option(old, "_gone_" + old.strip("-").replace("-", "_"), hidden=True, expose_value=False,
                        default=None, callback=fail)


def _set_verbosity(ctx, param, value):
    if value:
        logging.basicConfig(level=[logging.WARNING, logging.INFO, logging.DEBUG][min(value, 2)], force=True,
                            format="%(asctime)s %(name)s %(levelname)s %(message)s")
    return value


# -v before or after the subcommand, on edge-agent and edge-hub alike
verbose_option = click.option("-v", "--verbose", count=True, expose_value=False, callback=_set_verbosity,
                              help="-v info, -vv debug logging")
