"""`edge-agent run`: put this device into a star as a target, a draft service or a SUN worker.

target:  verifies locally, drafts come from the hub's star (StarSD); serves an
         OpenAI-compatible endpoint to local clients (--http-port), or
         generates once for --prompt and exits.
draft:   a draft service that registers with the hub and takes sessions.
prefill: SUN: one task specialist's prefill module (--module DIR, --task);
         the hub routes that task's requests here, the KV goes to a decoder.
         With adapters: the base once and a LoRA adapter per task (--adapter TASK=PATH,
         or a bundle listing adapters on llamacpp); it serves every adapter's task.
decoder: SUN: a shared decoder (--module DIR) batching requests of every task.
drafter: the reverse star: a device too small for the target drafts with --model (a small
         model) and the hub's verify service (`edge-hub serve --verify-model`) verifies; its
         OpenAI endpoint serves the target's output (edge/cli/drafter_role.py).

`run` reads its options into an AgentConfig (agent_config_from) and hands it to start_role,
the factory that loads what the role needs and runs it until a signal
(edge/cli/agent_roles.py holds each role's loop).
"""
from __future__ import annotations

import logging
import socket
from dataclasses import dataclass, replace
from typing import Optional

import click

from edge.cli.agent_config import config_option
# open_node: the SUN nodes' factory, imported from here by tests and provisioning checks
from edge.cli.agent_roles import TargetSettings, open_node, run_draft, run_sun, run_target  # noqa: F401
from edge.cli.broker_options import (broker_access, BrokerAccess, CLIENT_TLS_HELP, credential_options, ctl_key_option,
                                     hub_url_option, keepalive_option, read_ctl_key, tls_dir_option)
from edge.cli.options import (verbose_option, backend_option, draft_limits, draft_options, gamma_option, hubs_option,
                              model_options, stop_ids_option, telemetry_options)
from edge.cli.options import parallel_options, prompt_cache_options
from edge.cli.plan_command import check_before_load, memory_options
from edge.cli.sections import ROLE, SUN, TARGET, SectionedCommand, option
from edge.cli.startup import (DraftSetup, TelemetrySettings, build_draft, open_model_for_command,
                              resolve_for_command)
from edge.sun.worker_limits import DEFAULT_MAX_QUEUE, DEFAULT_MAX_SEQUENCES

SUN_ROLES = ("prefill", "decoder")


@dataclass
class ModelSettings:
    """The role's model and how it loads: --model or --module, --backend, --dtype, --threads,
    --max-len, where it runs (--accelerator, --gpu-layers), llama.cpp's weight repacking (--repack)
    and the memory budget it is checked against first (--profile, --memory-budget)."""
    model: Optional[str]
    module_dir: Optional[str]
    backend: str
    dtype: str
    threads: Optional[int]
    max_len: int
    profile: Optional[str]
    memory_budget: Optional[str]
    device: str = "auto"
    gpu_layers: Optional[str] = None        # N | all (llama.cpp)
    repack: str = "auto"                    # auto | on | off | both (llama.cpp: edge/engines/llamacpp_repack.py)
    exact_rows: bool = False                # --exact-rows (llama.cpp: edge/engines/llamacpp_rows.py)


@dataclass
class SunSettings:
    """--task, --max-batch, --max-sequences, --max-queue, --stop-id of a SUN worker."""
    task: Optional[str]
    max_batch: int
    max_sequences: int
    max_queue: int
    stop_ids: tuple
    adapters: tuple = ()            # prefill: (task, path) of each --adapter
    tokenizer: Optional[str] = None  # --tokenizer: the base model's, to follow request grammars
    with_decoder: bool = False      # prefill --with-decoder: the shared decoder too, on the same base
    grammars_on_demand: bool = False  # --grammars-on-demand: the grammar tokenizer at the first grammar


@dataclass
class AgentConfig:
    """Everything `edge-agent run` was told, read and checked: what start_role builds from."""
    role: str
    client_id: str
    broker: BrokerAccess
    ctl_key: Optional[bytes]
    telemetry: TelemetrySettings
    model: ModelSettings
    draft: Optional[DraftSetup]          # --role draft
    target: TargetSettings
    sun: SunSettings


@click.command(cls=SectionedCommand)
@config_option
@option(ROLE, "--role", required=True, type=click.Choice(["target", "draft", "prefill", "decoder", "drafter"]))
@option(ROLE, "--model", "-m", default=None, help="target/draft: model name (see edge.model.fetch) or path")
@option(ROLE, "--module", "module_dir", default=None, metavar="DIR",
        help="prefill/decoder: the specialist or shared-decoder directory (edge-export tune)")
@option(ROLE, "--client-id", default=None, help="this device's id (default: the host name)")
@hub_url_option()
@credential_options
@tls_dir_option(CLIENT_TLS_HELP)
@keepalive_option
@ctl_key_option
@backend_option(default="auto",
                help="engine: torch (checkpoints), onnx / llamacpp (a bundle or .onnx / .gguf file); "
                     "prefill/decoder: torch (the tuned directory) or onnx / llamacpp (its bundle); auto: "
                     "what the artifact is (a .gguf on llama.cpp where installed, a bundle's artifact for "
                     "the role, a checkpoint or tuned directory on torch)")
@model_options
@memory_options
@gamma_option(TARGET)
@hubs_option(TARGET, "a target joins the one that owns its --client-id; draft services and SUN workers "
                     "serve every hub and need no list")
@option(TARGET, "--http-host", default="127.0.0.1", show_default=True)
@option(TARGET, "--http-port", default=8000, show_default=True, help="target: OpenAI endpoint port (0: none)")
@option(TARGET, "--prompt", default=None, help="target: generate once for this prompt and exit")
@option(TARGET, "--max-new", "-n", default=128, show_default=True, help="target with --prompt: new tokens")
@option(TARGET, "--temperature", "-t", default=0.0, show_default=True, help="target with --prompt: 0 = greedy")
@prompt_cache_options(TARGET)
@parallel_options(TARGET)
@draft_options
@option(SUN, "--task", default=None, help="prefill: the task it serves (default: the manifest's)")
@option(SUN, "--max-batch", default=64, show_default=True, help="decoder: sequences per engine step")
@option(SUN, "--max-sequences", default=DEFAULT_MAX_SEQUENCES, show_default=True,
        help="decoder: sequences it holds, running and waiting; past it requests are refused (overloaded)")
@option(SUN, "--max-queue", default=DEFAULT_MAX_QUEUE, show_default=True,
        help="prefill: prompts waiting; past it requests are refused (overloaded)")
@option(SUN, "--adapter", "adapters", multiple=True, metavar="TASK=PATH",
        help="prefill: serve TASK with this prefill-only LoRA adapter over the base --module names (torch: the "
             "shared decoder's directory and a PEFT adapter directory; llamacpp: a bundle and a GGUF LoRA); "
             "repeat for more tasks")
@option(SUN, "--with-decoder", is_flag=True,
        help="prefill with adapters: also run the shared decoder in this process on the SAME base (one copy of "
             "the weights instead of two; its id is CLIENT_ID-decoder; --max-batch / --max-sequences / --stop-id "
             "are its). For one machine serving both roles; not with broker credentials (edge/cli/colocated_role.py)")
@option(SUN, "--grammars-on-demand", is_flag=True,
        help="with --with-decoder: load the tokenizer request grammars need (and llguidance's) at the first "
             "request with a grammar, not at start: ~200 MB less on Qwen's 150k vocabulary until then, and "
             "that request waits seconds")
@option(SUN, "--tokenizer", default=None, metavar="MODEL",
        help="prefill/decoder: the base model's tokenizer (a model name or path), so the worker follows a "
             "request's grammar (response_format, a forced tool_choice); a bundle that carries its tokenizer "
             "needs none. Without one the worker serves requests without grammars only")
@stop_ids_option("decoder")
@telemetry_options
@verbose_option
def run(**options):
    """Join the star at --broker as a target, a draft service or a SUN worker (runs until Ctrl-C)."""
    start_role(agent_config_from(options))


def agent_config_from(o: dict) -> AgentConfig:
    """`run`'s options (by parameter name) checked and read: credentials, TLS files, the key."""
    from edge.wire.link import LinkError, parse_urls
    from edge.wire.protocol import ProtocolError, check_id

    role = o["role"]
    client_id = o["client_id"] or o["username"] or socket.gethostname().split(".")[0]
    try:
        check_id(client_id, "--client-id")
        parse_urls(o["hub_url"])
    except (ProtocolError, LinkError) as e:
        raise click.BadParameter(str(e)) from None
    broker = broker_access(o, client_id)
    if broker.password and not broker.username:
        broker.username = client_id
    ctl_key = read_ctl_key(o["ctl_key_file"])
    if role in SUN_ROLES and not o["module_dir"]:
        raise click.UsageError(f"--role {role} needs --module DIR (a SUN specialist or shared-decoder directory)")
    if role not in SUN_ROLES and not o["model"]:
        raise click.UsageError(f"--role {role} needs --model")
    if o["drafter"] != "model" and role != "draft":
        raise click.UsageError(f"--drafter {o['drafter']} is for --role draft (a target verifies; the hub or a "
                               "draft service drafts)")
    draft = DraftSetup(o["drafter"], o["model"], draft_limits(o), o["suffix_min_score"]) if role == "draft" else None
    gamma, adaptive = o["gamma"]            # STAR_GAMMA: (γ or the largest γ, auto?)
    return AgentConfig(
        role, client_id, broker, ctl_key, TelemetrySettings.from_options(o),
        ModelSettings(o["model"], o["module_dir"], o["backend"], o["dtype"], o["threads"], o["max_len"],
                      o["profile"], o["memory_budget"], o["device"], o["gpu_layers"], o["repack"],
                      bool(o.get("exact_rows"))),
        draft,
        TargetSettings(gamma, adaptive, o["http_host"], o["http_port"], o["prompt"], o["max_new"], o["temperature"],
                       o["hubs"], o["prompt_cache"], o["prompt_cache_mb"], o["prompt_cache_ram"], o["parallel"],
                       o["queue"]),
        SunSettings(o["task"], o["max_batch"], o["max_sequences"], o["max_queue"], o["stop_ids"],
                    _adapter_pairs(role, o.get("adapters") or ()), _sun_tokenizer(role, o.get("tokenizer")),
                    _with_decoder(role, o.get("with_decoder")), _on_demand(o)))


def _with_decoder(role: str, given: bool) -> bool:
    if given and role != "prefill":
        raise click.UsageError("--with-decoder is for --role prefill (a prefill worker with adapters)")
    return bool(given)


def _on_demand(o: dict) -> bool:
    if o.get("grammars_on_demand") and not o.get("with_decoder"):
        raise click.UsageError("--grammars-on-demand is for --role prefill --with-decoder")
    return bool(o.get("grammars_on_demand"))


def _sun_tokenizer(role: str, given: Optional[str]) -> Optional[str]:
    if given and role not in SUN_ROLES:
        raise click.UsageError("--tokenizer is for --role prefill or decoder (a target or draft reads its model's)")
    return given


def _adapter_pairs(role: str, given) -> tuple:
    """--adapter TASK=PATH values -> ((task, path), ...), each task named once."""
    from edge.wire.protocol import ProtocolError, check_id
    if given and role != "prefill":
        raise click.UsageError("--adapter is for --role prefill")
    pairs = []
    for item in given:
        task, sep, path = item.partition("=")
        try:
            check_id(task, "--adapter's task")
        except ProtocolError as e:
            raise click.BadParameter(f"{item!r}: {e}; write --adapter TASK=PATH") from None
        if not sep or not path:
            raise click.BadParameter(f"{item!r}: write --adapter TASK=PATH (the adapter's directory or GGUF file)")
        if task in dict(pairs):
            raise click.BadParameter(f"--adapter names task {task!r} twice")
        pairs.append((task, path))
    return tuple(pairs)


def start_role(cfg: AgentConfig) -> None:
    """The factory of `edge-agent run`: resolve the role's model (once: everything below takes the
    ResolvedModel), load what cfg.role needs (a role that does not fit its memory budget is
    refused first), then run it on the star until a signal."""
    m = cfg.model
    if cfg.role in SUN_ROLES:             # the module dir carries its own model
        from edge.cli.placing import place_model
        model = resolve_for_command(m.module_dir, m.backend, role_of=lambda base: sun_role(cfg, base))
        placement = place_model(model, m.device, m.gpu_layers, m.profile, repack=m.repack)
        check_before_load(model.role, model, None, m.profile, m.memory_budget, max_batch=cfg.sun.max_batch,
                          placement=placement)
        if cfg.sun.with_decoder:
            from edge.cli.colocated_role import run_colocated
            run_colocated(cfg.broker, model, cfg.client_id, cfg.sun, m.threads, model.backend, cfg.ctl_key,
                          cfg.telemetry, engine_kw=placement.engine_kwargs())
            return
        run_sun(cfg.role, cfg.broker.link(), model, cfg.client_id, cfg.sun, m.threads, model.backend,
                cfg.ctl_key, cfg.telemetry, engine_kw=placement.engine_kwargs())
    elif cfg.role == "draft":
        # a suffix draft reads only the model's tokenizer: any of a bundle's artifacts names it
        model = resolve_for_command(m.model, m.backend, None if cfg.draft.kind == "suffix" else "draft")
        core, tok = build_draft(replace(cfg.draft, model=model), cfg.client_id, lambda: _open_planned(cfg, model))
        run_draft(core, tok, cfg.broker.link(), cfg.client_id, cfg.ctl_key, cfg.telemetry)
    elif cfg.role == "drafter":           # its model drafts: a bundle's draft artifact, planned as a target's
        from edge.cli.drafter_role import run_drafter
        model = resolve_for_command(m.model, m.backend, "draft")
        engine, tok = _open_planned(replace(cfg, role="target"), model)
        run_drafter(engine, tok, cfg.broker.link(), cfg.client_id, model.name, cfg.target, cfg.telemetry,
                    cfg.ctl_key)
    else:
        model = resolve_for_command(m.model, m.backend, cfg.role)
        engine, tok = _open_planned(cfg, model)
        run_target(engine, tok, cfg.broker.link(), cfg.client_id, model.name, cfg.target, cfg.telemetry,
                   cfg.ctl_key)


def sun_role(cfg: AgentConfig, module) -> str:
    """The role whose artifact a SUN worker runs: a prefill worker over adapters (--adapter, or a
    bundle whose manifest lists them) runs the base, the decoder's artifact."""
    from edge.sun.adapter_prefill import listed_tasks
    if cfg.role == "prefill" and (cfg.sun.adapters or listed_tasks(module)):
        return "decoder"
    return cfg.role


def _open_planned(cfg: AgentConfig, model):
    """The role's ResolvedModel, placed (edge/cli/placing.py: the start line says where and why),
    then opened with what its memory plan counted on that placement (and refused if it does not fit)."""
    from edge.cli.placing import place_model
    m, limits = cfg.model, cfg.draft.limits if cfg.draft else None
    placement = place_model(model, m.device, m.gpu_layers, m.profile, repack=m.repack,
                            exact_rows=m.exact_rows and cfg.role == "target")   # a draft needs none
    chosen: dict = {}
    engine_kw = check_before_load(cfg.role, model, m.max_len, m.profile, m.memory_budget,
                                  dtype=m.dtype, max_sessions=limits.max_sessions if limits else 64,
                                  max_kv_mb=limits.max_kv_mb if limits else 1024.0, placement=placement,
                                  prompt_cache=(cfg.target.prompt_cache, cfg.target.prompt_cache_mb,
                                                cfg.target.prompt_cache_ram),
                                  parallel=cfg.target.parallel, chosen=chosen)
    if cfg.target.prompt_cache_ram is None and "prompt_cache_ram" in chosen:
        cfg.target = replace(cfg.target, prompt_cache_ram=chosen["prompt_cache_ram"])   # what the plan left it
    return open_model_for_command(model, m.dtype, m.threads, m.max_len, placement=placement, **engine_kw)
