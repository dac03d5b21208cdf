"""`edge-agent plan`: will a role fit a device? And the check `edge-agent run` makes before it loads.

    edge-agent plan --profile jetson-orin-nano-8gb --role target -m qwen2.5-coder-1.5b -b llamacpp
    edge-agent plan --memory-budget 2G --role draft -m qwen2.5-coder-0.5b --max-sessions 16 --json

The numbers come from edge/memory/fit.py (estimates calibrated against measured peak RSS,
benchmarks/results/memory_plan/default.md); the budget from a device profile's usable memory
(devices/profiles/*.toml; devices/profile.py imports nothing from server/ or export/, so edge
may read it) or from --memory-budget, which wins over the profile.
"""
from __future__ import annotations

import json
from dataclasses import replace
from typing import Optional

import click

from edge.cli.device_profiles import load_device
from edge.cli.options import (backend_option, dtype_option, parallel_options, prompt_cache_options, renamed_option,
                              repack_option)
from edge.cli.sections import MODEL, TARGET, option
from edge.memory.fit import (Fit, Workload, cache_slots_that_fit, engine_kwargs, engine_sequences, fit, parse_bytes,
                             role_sequences)

GB = 1e9
_DEFAULT_CTX = 4096                     # `edge-agent run --max-len`'s default
_SUN_CTX = {"llamacpp": 1024}           # SUN roles load their engine with its own default context


def memory_options(f):
    """--profile and --memory-budget of `edge-agent run` (the budget its role is checked against)."""
    f = option(MODEL, "--memory-budget", default=None, metavar="SIZE",
               help="refuse to load a role whose memory plan exceeds this, e.g. 5.5G (wins over --profile)")(f)
    return option(MODEL, "--profile", default=None,
                  help="device profile (devices/profiles/*.toml): refuse a role that does not fit its usable "
                       "memory (see `edge-agent plan`)")(f)


def budget_bytes(profile: Optional[str], memory_budget: Optional[str]) -> Optional[int]:
    """--memory-budget, else the profile's usable memory, else None (nothing to enforce)."""
    if memory_budget:
        try:
            return parse_bytes(memory_budget)
        except ValueError as e:
            raise click.BadParameter(str(e), param_hint="--memory-budget") from None
    if profile:
        return int(load_device(profile).usable_memory_gb * GB)
    return None


def make_plan(role: str, model, budget: Optional[int], max_len: Optional[int] = None,
              max_batch: int = 64, max_sessions: int = 64, dtype: str = "float32", gamma: int = 4,
              max_kv_mb: Optional[float] = None, adapters: Optional[tuple] = None,
              prompt_cache: Optional[tuple] = None, parallel: int = 1, twin: bool = False):
    """(Fit or None without a budget, Estimate) for a role as `edge-agent run` would load the
    ResolvedModel `model` (on its backend); adapters = (count, rank, targets, itemsize) of the
    LoRA specialists a prefill worker holds; prompt_cache = (slots, MB[, RAM MB]) of a target's
    (--prompt-cache, --prompt-cache-mb, --prompt-cache-ram: edge/speculative/prefix_cache.py); parallel: a target's
    generations at once (--parallel), a sequence each; twin: --repack both's unrepacked copy (llama.cpp)."""
    from edge.engines.base import EngineError
    from edge.memory.fit import estimate
    try:
        shape = model.shape
    except (EngineError, OSError, ValueError) as e:
        raise click.ClickException(f"cannot size {model.ref}: {e}") from None
    b = model.backend
    if max_len is None:
        max_len = _SUN_CTX.get(b, shape.max_position) if role in ("prefill", "decoder") else _DEFAULT_CTX
    w = Workload(role, b, int(max_len), role_sequences(role, b, max_sessions, max_batch, parallel), dtype=dtype,
                 gamma=gamma, max_kv_bytes=int(max_kv_mb * 1e6) if max_kv_mb and role == "draft" else None,
                 adapters=adapters[0] if adapters else 0, adapter_bytes=_adapters_bytes(shape, role, adapters),
                 cache_slots=cache_slots(role, prompt_cache),
                 cache_bytes=int(prompt_cache[1] * 1e6) if cache_slots(role, prompt_cache) else None, twin=twin)
    w = replace(w, saved_bytes=_saved_bytes(shape, w, budget, prompt_cache))
    if budget is None:
        return None, estimate(shape, w)
    f = fit(shape, w, budget)
    return f, f.estimate


def _saved_bytes(shape, w: Workload, budget: Optional[int], prompt_cache: Optional[tuple]) -> int:
    """The host memory a target's prompt cache may fill with saved conversations (--prompt-cache-ram MB;
    None, its default: DEFAULT_RAM_MB, or what the budget leaves when that is less, down to none)."""
    from edge.memory.fit import estimate
    from edge.speculative.saved_prompts import DEFAULT_RAM_MB
    if not w.cache_slots or not prompt_cache or len(prompt_cache) < 3:
        return 0
    if prompt_cache[2] is not None:
        return int(prompt_cache[2] * 1e6)
    want = int(DEFAULT_RAM_MB * 1e6)
    if budget is None:
        return want
    room = budget - estimate(shape, w).total
    return max(0, min(want, room // 10 ** 6 * 10 ** 6))


def cache_slots(role: str, prompt_cache: Optional[tuple]) -> int:
    """The prompt cache's slots a role holds: a target's --prompt-cache, none elsewhere."""
    return int(prompt_cache[0]) if prompt_cache and role == "target" else 0


def _adapters_bytes(shape, role: str, adapters: Optional[tuple]) -> int:
    """N x one adapter's tensor bytes (edge/memory/adapters.py); only a prefill worker holds them."""
    if not adapters or not adapters[0]:
        return 0
    if role != "prefill":
        raise click.UsageError("--adapters is for --role prefill: only the prefill worker holds adapters")
    from edge.memory.adapters import adapter_bytes
    if len(adapters) == 2:                # a bundle's: (count, their GGUF files' bytes)
        return adapters[1]
    n, rank, targets, itemsize = adapters
    if n < 0:
        raise click.BadParameter("must be 0 or more", param_hint="--adapters")
    try:
        return n * adapter_bytes(shape, rank, targets, itemsize)
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--adapter-rank / --adapter-targets") from None


def bundle_adapters(model) -> Optional[tuple]:
    """(count, bytes) of the GGUF LoRA files a resolved bundle's manifest lists (what a llama.cpp
    worker loads from it: every adapter), or None when it lists none."""
    from edge.engines.loader import BundleError
    from edge.engines.lora_bundle import adapter_entries
    try:
        entries = adapter_entries(model)
    except BundleError as e:
        raise click.ClickException(str(e)) from None
    return (len(entries), sum(int(a["files"][0]["bytes"]) for a in entries)) if entries else None


def specialists(f: Optional[Fit], e):
    """SpecialistFit of a prefill plan with a budget: full copies vs adapters in what is left."""
    if f is None or e.workload.role != "prefill":
        return None
    from edge.memory.adapters import specialists_that_fit
    held = e.parts.get("adapters", 0)
    n = e.workload.adapters
    one = held // n if n else 0
    return specialists_that_fit(f.budget - (e.total - held), e.parts["weights"], one)


def advice(f: Fit) -> list:
    """What to change so the role fits (empty when it does)."""
    if f.fits:
        return []
    w, e = f.estimate.workload, f.estimate
    out = []
    if f.max_context and w.role in ("target", "draft"):   # SUN roles take their module's context
        out.append(f"lower --max-len to {f.max_context} or less")
    if w.role in ("draft", "decoder") and f.max_sequences:
        flag = "--max-sessions" if w.role == "draft" else "--max-batch"
        out.append(f"lower {flag} to {f.max_sequences} or less")
    if w.role == "target" and w.sequences > 1 and f.max_sequences and f.max_sequences < w.sequences:
        out.append(f"lower --parallel to {f.max_sequences} or less")
    saved = e.parts.get("saved prompts", 0)
    if saved and e.total - saved <= f.budget:       # (its default fits itself to the budget: asked for)
        out.append(f"lower --prompt-cache-ram to {(f.budget - e.total + saved) // 10 ** 6} MB or less")
    slots = cache_slots_that_fit(e.shape, replace(w, saved_bytes=0), f.budget) if w.cache_slots else None
    if slots is not None:                 # a target's prompt cache (each slot is a sequence on llama.cpp)
        out.append(f"lower --prompt-cache to {slots} or less" + (" and --prompt-cache-ram to 0" if saved else ""))
    if e.parts.get("adapters") and e.total - e.parts["adapters"] <= f.budget:
        n = e.workload.adapters
        one = e.parts["adapters"] // max(1, n)
        out.append(f"hold at most {(f.budget - e.total + e.parts['adapters']) // one} adapters of "
                   f"{one / 1e6:.2f} MB each (lower --adapters or --adapter-rank), or start another worker")
    if not out:
        fixed = e.total - e.parts["kv"]
        out.append(f"even without KV the role needs {fixed / GB:.2f} GB: use a smaller model or quantisation "
                   "(GGUF Q4_0 / ONNX int4), or a device with more memory")
    if w.role == "target":                # the reverse star: the hub holds the target, this device drafts
        out.append("join as a drafter instead (`edge-agent run --role drafter -m` a small draft model: the hub's "
                   "`edge-hub serve --verify-model` holds the target and verifies)")
    return out


def refusal(f: Fit, where: str) -> str:
    e = f.estimate
    return (f"{e.workload.role} on {e.workload.backend} does not fit {where}: it needs {e.total / GB:.2f} GB "
            f"(weights {e.parts['weights'] / GB:.2f}, KV {e.parts['kv'] / GB:.2f} for {e.workload.sequences} x "
            f"{e.workload.context} tokens, compute {e.parts['compute'] / GB:.2f}, runtime "
            f"{(e.parts['runtime'] + e.parts['tokenizer']) / GB:.2f}"
            + (f", adapters {e.parts['adapters'] / GB:.3f}" if e.parts.get("adapters") else "")
            + f"), the budget is {f.budget / GB:.2f} GB: "
            + "; or ".join(advice(f)))


def check_before_load(role, model, max_len, profile, memory_budget, max_batch=64, max_sessions=64,
                      dtype="float32", max_kv_mb=None, placement=None, prompt_cache=None, parallel=1,
                      chosen: Optional[dict] = None) -> dict:
    """`edge-agent run`'s check of a ResolvedModel: refuse a role that does not fit, before anything
    loads; returns the engine arguments the plan counted (llama.cpp: n_seq_max). With a `placement` on a GPU, or on
    a discrete-GPU profile (whose usable memory is the card's), each side (host, GPU, or a Jetson's
    shared pool) is checked where its bytes live. prompt_cache: a target's (slots, MB, RAM MB or None),
    counted too; `chosen` gets the RAM MB the plan gave it ("prompt_cache_ram": its default fits the budget)."""
    if placement is not None and profile and (placement.on_gpu or load_device(profile).kind == "gpu"):
        return _check_placed(role, model, max_len, profile, memory_budget, max_batch, max_sessions,
                             dtype, max_kv_mb, placement, prompt_cache, parallel, chosen)
    budget = budget_bytes(profile, memory_budget)
    try:
        f, e = make_plan(role, model, budget, max_len, max_batch, max_sessions, dtype, max_kv_mb=max_kv_mb,
                         prompt_cache=prompt_cache, parallel=parallel, twin=_twin(placement))
    except click.ClickException:
        if budget is not None:
            raise                         # a budget it cannot check is not enforced silently
        b = model.backend                 # unsized (the loader will say why, if it cannot load it)
        running = role_sequences(role, b, max_sessions, max_batch, parallel)
        n = engine_sequences(b, running, cache_slots(role, prompt_cache))
        return engine_kwargs(b, role, n)
    if f is not None and not f.fits:
        where = f"--memory-budget {memory_budget}" if memory_budget else f"profile {profile}"
        raise click.ClickException(refusal(f, where))
    if f is not None:
        click.echo(f"memory plan: {e.total / GB:.2f} GB of {f.budget / GB:.2f} GB "
                   f"(KV {e.kv_bytes_per_token} B/token)", err=True)
    return _chosen(e, chosen)


def _chosen(e, chosen: Optional[dict]) -> dict:
    """The engine arguments the plan `e` counted; `chosen` told the prompt cache's RAM it counted."""
    if chosen is not None:
        chosen["prompt_cache_ram"] = e.workload.saved_bytes / 1e6
    return engine_kwargs(e.workload.backend, e.workload.role, e.workload.engine_sequences)


def _twin(placement) -> bool:
    """Does the placement load --repack both's unrepacked copy beside the model (llamacpp_twin.py)?"""
    return placement is not None and getattr(placement, "repack", "auto") == "both"


def _check_placed(role, model, max_len, profile, memory_budget, max_batch, max_sessions, dtype, max_kv_mb,
                  placement, prompt_cache=None, parallel=1, chosen=None) -> dict:
    """check_before_load by sides: the estimate split by where it is placed (edge/memory/placed.py),
    each side against its budget (a side the profile does not size is not checked)."""
    from edge.memory.placed import MemorySides, check_sides, gpu_fraction
    sides = MemorySides.of_profile(load_device(profile), budget_bytes(None, memory_budget))
    def plan(cache):
        _, e = make_plan(role, model, None, max_len, max_batch, max_sessions, dtype, max_kv_mb=max_kv_mb,
                         prompt_cache=cache, parallel=parallel, twin=_twin(placement))
        return e, check_sides(e, gpu_fraction(placement, e.shape.layers), sides)
    e, why = plan(prompt_cache)
    if why and e.parts.get("saved prompts") and prompt_cache[2] is None:
        e, why = plan((*prompt_cache[:2], 0.0))      # the RAM tier's default gives way (no room on a side)
    if why:
        raise click.ClickException(f"{role} on {e.workload.backend} placed on {placement.device} does not fit "
                                   f"profile {profile}: it {why}; lower --max-len, use a smaller model or "
                                   "quantisation, or move layers between GPU and CPU (--gpu-layers N)")
    click.echo(f"memory plan: {e.total / GB:.2f} GB, placed on {placement.device} of profile {profile}", err=True)
    return _chosen(e, chosen)


def format_table(f: Optional[Fit], e, profile: Optional[str]) -> str:
    w = e.workload
    rows = [("model", f"{e.shape.name} ({e.shape.quant})"), ("role / backend", f"{w.role} / {w.backend}"),
            ("context x sequences", f"{w.context} x {w.sequences}"
                                    + (f" + {w.cache_slots} in the prompt cache" if w.cache_slots else "")
                                    + (" + 1 spare to gather running ones" if w.engine_sequences > w.sequences
                                       + w.cache_slots else ""))]
    rows += [(k, f"{v / GB:.3f} GB") for k, v in e.parts.items()]
    rows += [("total", f"{e.total / GB:.3f} GB"), ("KV per token", f"{e.kv_bytes_per_token} B")]
    if f is not None:
        rows += [("budget", f"{f.budget / GB:.3f} GB" + (f" ({profile})" if profile else "")),
                 ("fits", f"yes, {f.headroom / GB:.3f} GB to spare" if f.fits
                  else f"NO, short by {-f.headroom / GB:.3f} GB"),
                 ("largest context", f"{f.max_context} (at {w.sequences} sequences)"),
                 ("KV budget", f"{max(0, f.kv_budget_bytes) / GB:.3f} GB "
                               f"({max(0, f.kv_budget_bytes) // max(1, e.kv_bytes_per_token)} tokens)")]
        if w.role in ("draft", "decoder"):
            rows.append(("most " + ("sessions" if w.role == "draft" else "batch rows"),
                         f"{f.max_sequences} (at {w.context} tokens each)"))
        rows += [("change", a) for a in advice(f)]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


@click.command()
@click.option("--profile", default=None, help="device profile (devices/profiles/*.toml): its usable memory")
@click.option("--memory-budget", default=None, metavar="SIZE", help="a budget instead, e.g. 5.5G, 800M")
@click.option("--role", required=True, type=click.Choice(["target", "draft", "prefill", "decoder"]))
@click.option("--model", "-m", default=None, help="model name (edge.model.fetch) or path: GGUF, HF dir, .onnx")
@click.option("--bundle", default=None, type=click.Path(exists=True), help="a bundle (edge-export bundle)")
@click.option("--module", "module_dir", default=None, type=click.Path(exists=True),
              help="a SUN specialist / shared-decoder directory or its bundle")
@backend_option(default="auto", help="engine the role runs on (auto: as the loader picks for the file)")
@click.option("--max-len", type=int, default=None, help=f"context per sequence (default {_DEFAULT_CTX}; "
              "SUN roles: their engine's default)")
@click.option("--max-batch", type=int, default=64, show_default=True, help="decoder: rows per step")
@click.option("--max-sessions", type=int, default=64, show_default=True, help="draft: sessions")
@click.option("--max-kv-mb", type=float, default=None, help="draft on torch/onnx: the service's KV cap")
@dtype_option
@renamed_option("--device", "--accelerator auto|cpu|cuda")
@click.option("--accelerator", "device", default="auto", show_default=True, type=click.Choice(["auto", "cpu", "cuda"]),
              help="where the role runs on the device (auto: its GPU where the profile has one)")
@click.option("--gpu-layers", default=None, metavar="N|all", help="llamacpp: layers on the GPU")
@repack_option
@click.option("--adapters", "n_adapters", type=int, default=0, show_default=True,
              help="prefill: LoRA specialists the worker holds beside its base")
@click.option("--adapter-rank", type=int, default=16, show_default=True, help="their LoRA rank")
@click.option("--adapter-targets", default="q,k,v,o,gate,up,down", show_default=True,
              help="the linears each adapts (edge-export tune --targets)")
@click.option("--adapter-dtype", default="F32", show_default=True, type=click.Choice(["F32", "F16"]),
              help="their tensors' dtype (edge-export adapter --ftype; torch PEFT files: F32)")
@prompt_cache_options(TARGET)
@parallel_options(TARGET, queue=False)
@click.option("--json", "as_json", is_flag=True, help="print JSON instead of the table")
def plan(profile, memory_budget, role, model, bundle, module_dir, backend, max_len, max_batch, max_sessions,
         max_kv_mb, dtype, device, gpu_layers, repack, n_adapters, adapter_rank, adapter_targets, adapter_dtype,
         prompt_cache, prompt_cache_mb, prompt_cache_ram, parallel, as_json):
    """Estimate a role's memory on a device: fits or not, by how much, and the most that fits."""
    given = [x for x in (model, bundle, module_dir) if x]
    if len(given) != 1:
        raise click.UsageError("give exactly one of --model, --bundle, --module")
    budget = budget_bytes(profile, memory_budget)
    from edge.memory.adapters import ADAPTER_ITEMSIZE, parse_targets
    try:
        targets = parse_targets(adapter_targets)
    except ValueError as err:
        raise click.BadParameter(str(err), param_hint="--adapter-targets") from None
    ad = (n_adapters, adapter_rank, targets, ADAPTER_ITEMSIZE[adapter_dtype]) if n_adapters else None
    from edge.cli.startup import resolve_for_command
    model = resolve_for_command(given[0], backend, role)          # the one resolution of this command
    if bundle and role == "prefill" and not n_adapters:
        ad = bundle_adapters(model)
    f, e = make_plan(role, model, budget, max_len, max_batch, max_sessions, dtype, max_kv_mb=max_kv_mb,
                     adapters=ad, prompt_cache=(prompt_cache, prompt_cache_mb, prompt_cache_ram),
                     parallel=parallel,
                     twin=repack == "both")
    sp = specialists(f, e)
    placed = _placed(e, profile, memory_budget, device, gpu_layers, repack)
    if as_json:
        d = f.to_dict() if f is not None else e.to_dict()
        d.update(profile=profile, advice=advice(f) if f is not None else [], placement=placed,
                 engine_kwargs=engine_kwargs(e.workload.backend, role, e.workload.engine_sequences),
                 adapters=e.workload.adapters, specialists=sp.to_dict() if sp else None)
        click.echo(json.dumps(d, indent=1, sort_keys=True))
    else:
        click.echo(format_table(f, e, profile))
        if sp is not None:
            click.echo(format_specialists(sp))
        if placed is not None:
            click.echo(format_placed(placed))


def _placed(e, profile, memory_budget, device, gpu_layers, repack="auto") -> Optional[dict]:
    """Where the plan's bytes live on the profile's device (edge/memory/placed.py), or None."""
    if not profile:
        return None
    from edge.engines.placement import PlacementError
    from edge.memory.placed import MemorySides, placed_report, planned_placement
    dev = load_device(profile)
    try:
        placement = planned_placement(e.workload.backend, device, gpu_layers, dev, repack)
    except PlacementError as err:
        raise click.ClickException(str(err)) from None
    return placed_report(e, placement, MemorySides.of_profile(dev, budget_bytes(None, memory_budget)))


def format_specialists(sp) -> str:
    """How many task specialists fit what the worker leaves of the budget, each way."""
    rows = [("left for specialists", f"{sp.left_bytes / GB:.3f} GB"),
            ("as full copies", f"{sp.full_copies} (each {sp.full_copy_bytes / 1e6:.1f} MB: the prefill module again)")]
    if sp.adapter_bytes:
        rows.append(("as adapters", f"{sp.adapters} (each {sp.adapter_bytes / 1e6:.2f} MB)"))
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def format_placed(p: dict) -> str:
    def gb(n):
        return "not checked" if n is None else f"{n / GB:.3f} GB"
    rows = [("placed", f"{p['device']} ({p['reason']})"), ("on the host", gb(p["host_bytes"])),
            ("on the GPU", gb(p["gpu_bytes"]))]
    if p["unified"]:
        rows.append(("shared pool", f"{gb(p['host_budget_bytes'])} (unified: CPU and GPU share it)"))
    else:
        rows += [("host budget", gb(p["host_budget_bytes"])), ("GPU budget", gb(p["gpu_budget_bytes"]))]
    rows.append(("fits where placed", "yes" if p["refusal"] is None else f"NO: it {p['refusal']}"))
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)
