"""`edge-agent`: run a role on a device, or generate locally with speculative decoding."""
from __future__ import annotations

import sys

import click

from edge.cli.options import adaptive_refusal, apply, backend_option, gamma_option, model_options, verbose_option
from edge.cli.options import open_prompt_cache, prompt_cache_options
from edge.cli.sections import GENERATION, MODEL, SectionedCommand, option
from edge.cli.startup import open_model_for_command, resolve_for_command

DEFAULT_TARGET = "qwen2.5-coder-1.5b"
DEFAULT_DRAFT = "qwen2.5-coder-0.5b"
DEMO_PROMPT = "Write a Python function that checks whether a number is prime."


def streamer(tokenizer):
    """on_token callback that prints text as it becomes complete (UTF-8 safe)."""
    stream = tokenizer.decode_stream(skip_special=True)

    def on_token(token: int) -> None:
        sys.stdout.write(stream.put(token))
        sys.stdout.flush()
    return on_token


def run_generation(target_ref, draft_ref, prompt, gamma, max_new, temperature, top_k, top_p,
                   seed, chat, compare, dtype, threads, max_len, backend="auto",
                   draft_backend=None, draft_top_k=64, device="auto", gpu_layers=None, prompt_cache=0,
                   prompt_cache_mb=1024.0, prompt_cache_ram=None, repack="auto", exact_rows=False):
    """gamma: (γ, adaptive) as --gamma reads it: the fixed γ, or the largest one a policy picks from.
    prompt_cache / prompt_cache_mb / prompt_cache_ram: the target's prompt cache (--compare's run reuses the prompt's KV).
    draft_ref None: a fetched model with the target's tokenizer (default_draft).
    device / gpu_layers / repack: where both models run and how llama.cpp lays out their weights
    (edge/engines/placement.py); exact_rows: the target's (edge/engines/llamacpp_rows.py)."""
    from edge.speculative.generate import ModelDrafter, generate_plain, generate_speculative
    from edge.speculative.ngram import NgramDrafter
    from edge.speculative.sampling import SamplingParams

    gamma, adaptive = gamma
    target_model = resolve_for_command(target_ref, backend, "target")
    target, tok = open_model_for_command(target_model, dtype, threads, max_len, device=device, gpu_layers=gpu_layers,
                                         repack=repack, exact_rows=exact_rows)
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
    draft_tok = None
    if draft_ref is None:
        draft_ref, draft_tok = default_draft(target_model, tok)
    if draft_ref == "ngram":
        drafter, draft_name = NgramDrafter(), "n-gram prompt lookup"
    elif draft_ref == "suffix":
        from edge.speculative.suffix_drafter import SuffixDrafter
        drafter, draft_name = SuffixDrafter(), "suffix trees (prompt + output)"
    else:
        draft_model = resolve_for_command(draft_ref, draft_backend or backend, "draft")
        draft, dtok = open_model_for_command(draft_model, dtype, threads, max_len, device=device,
                                             gpu_layers=gpu_layers, tokenizer=draft_tok, repack=repack)
        if dtok.fingerprint() != tok.fingerprint():
            raise click.ClickException(
                "draft and target use different tokenizers (fingerprints "
                f"{dtok.fingerprint()[:12]} vs {tok.fingerprint()[:12]}); speculative decoding "
                "needs the same vocabulary: pick a draft from the target's family")
        drafter, draft_name = ModelDrafter(draft, params, top_k=draft_top_k), draft_model.name
    text = tok.apply_chat_template([{"role": "user", "content": prompt}]) if chat else prompt
    ids = tok.encode(text)
    if len(ids) + max_new > target.max_len:
        raise click.ClickException(f"the prompt has {len(ids)} tokens; with {max_new} new tokens it "
                                   f"exceeds the context of {target.max_len}: shorten it or lower --max-new")
    stops = tuple(tok.eos_ids)
    click.echo(f"--- speculative: draft {draft_name}, γ={f'auto:{gamma}' if adaptive else gamma} ---", err=True)
    cache = open_prompt_cache(target, prompt_cache, prompt_cache_mb, prompt_cache_ram)
    spec = generate_speculative(target, drafter, ids, max_new, gamma, params, stop_ids=stops,
                                on_token=streamer(tok), adaptive=adaptive, cache=cache)
    click.echo("")
    rows = [("speculative", spec)]
    if compare:
        click.echo("--- target alone ---", err=True)
        plain = generate_plain(target, ids, max_new, params, stop_ids=stops, on_token=streamer(tok), cache=cache)
        click.echo("")
        rows.append(("target alone", plain))
    from edge.speculative.speedup_note import speedup_note
    why = speedup_note(spec, rows[1][1] if compare else None, drafter.policy if adaptive else None, gamma)
    report(rows, greedy=temperature == 0, why=why)
    return rows


def default_draft(target, tok) -> tuple:
    """(name, its tokenizer) of the draft `generate` uses when --draft is not given: the smallest
    model of edge.model.fetch that is fetched, smaller than the target and has its tokenizer (the
    same fingerprint); else ('ngram', None): prompt lookup, no model. Said on stderr."""
    from edge.engines.base import EngineError
    from edge.engines.loader import open_tokenizer
    from edge.model.checkpoint_files import CheckpointError
    from edge.model.fetch import MODELS, model_path
    from edge.model.resolved import resolve
    fp, vocab = tok.fingerprint(), target.shape.vocab
    for size, name in sorted((MODELS[n].size, n) for n in MODELS):
        p = model_path(name)
        if not p.is_file() or p.resolve() == target.path.resolve() or size >= target.shape.stored_bytes:
            continue
        try:
            cand = resolve(name, role="draft")
            dtok = open_tokenizer(cand) if cand.shape.vocab == vocab else None
            if dtok is not None and dtok.fingerprint() == fp:
                click.echo(f"draft: {name}, the smallest fetched model with {target.name}'s tokenizer "
                           "(--draft names another)", err=True)
                return name, dtok
        except (CheckpointError, EngineError, OSError):
            continue                      # an unreadable file is no candidate
    click.echo(f"draft: n-gram prompt lookup: no fetched model smaller than {target.name} has its tokenizer "
               "(name a draft of its family with --draft MODEL, or --draft suffix)", err=True)
    return "ngram", None


def report(rows, greedy, why=None):
    """The table of the runs, the speedup, and `why` (edge/speculative/speedup_note.py) when it did not pay."""
    spec = rows[0][1]
    click.echo(f"\n{'mode':<14}{'tokens':>8}{'tok/s':>9}{'accept':>9}{'tok/verify':>12}", err=True)
    for name, r in rows:
        tps = r.tokens_per_s
        acc = f"{r.acceptance_rate:.2f}" if r.n_drafted else "-"
        tpv = f"{r.tokens_per_verify:.2f}" if r.n_verify_calls else "-"
        click.echo(f"{name:<14}{len(r.tokens):>8}{tps:>9.2f}{acc:>9}{tpv:>12}", err=True)
    if len(rows) > 1:
        plain = rows[1][1]
        click.echo(f"speedup vs target alone: {spec.tokens_per_s / plain.tokens_per_s:.2f}x", err=True)
        if greedy:
            n = min(len(spec.tokens), len(plain.tokens))
            same = next((i for i in range(n) if spec.tokens[i] != plain.tokens[i]), n)
            click.echo(f"greedy outputs agree on the first {same} of {n} tokens"
                       + ("" if same == n else " (fp32 near-tie: multi-token and one-token calls round differently)"),
                       err=True)
    if why:
        click.echo(why, err=True)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@verbose_option
def main():
    """StarSun edge agent: run a role on a device, or generate locally."""


def generation_options(f):
    """What `generate` and `demo` share: γ, sampling, output, and how the models load."""
    return apply(f, [
        gamma_option(GENERATION),
        adaptive_refusal,
        option(GENERATION, "--max-new", "-n", default=64, show_default=True, help="new tokens to generate"),
        option(GENERATION, "--temperature", "-t", default=0.0, show_default=True, help="0 = greedy"),
        option(GENERATION, "--top-k", default=0, show_default=True, help="target top-k (0 = off)"),
        option(GENERATION, "--top-p", default=1.0, show_default=True, help="target nucleus p (1 = off)"),
        option(GENERATION, "--seed", default=0, show_default=True),
        option(GENERATION, "--chat/--raw", default=True, show_default=True, help="apply the chat template"),
        option(GENERATION, "--compare/--no-compare", default=True, show_default=True,
               help="also run the target alone and report the speedup"),
        # auto, as the loader resolves an artifact: a device without torch runs its .gguf / .onnx / bundle
        backend_option(default="auto", help="engine for the target (and the draft unless --draft-backend); auto: "
                       "by the artifact (.gguf: llamacpp when installed, .onnx: onnx, a bundle: its artifact, "
                       "else torch)"),
        backend_option("--draft-backend", default=None, help="engine for the draft (default: --backend)"),
        model_options,
        prompt_cache_options(GENERATION),
    ])


@main.command(cls=SectionedCommand)
@click.argument("prompt")
@option(MODEL, "--target", "-T", default=DEFAULT_TARGET, show_default=True, help="model name or path")
@option(MODEL, "--draft", "-D", default=None,
        help="draft model name/path, 'ngram' for prompt lookup or 'suffix' for suffix trees (no model); "
             f"default: the smallest fetched model with the target's tokenizer ({DEFAULT_DRAFT} for "
             f"{DEFAULT_TARGET}), else ngram")
@generation_options
def generate(prompt, target, draft, **kw):
    """Generate from PROMPT with a draft and a target on this machine."""
    run_generation(target, draft, prompt, **kw)


@main.command(cls=SectionedCommand)
@option(GENERATION, "--prompt", default=DEMO_PROMPT, show_default=True)
@generation_options
def demo(prompt, **kw):
    """The main job on one machine: Qwen2.5-Coder 0.5B drafts for 1.5B."""
    run_generation(DEFAULT_TARGET, DEFAULT_DRAFT, prompt, **kw)


from edge.cli.plan_command import plan as _plan_command  # noqa: E402  (memory plans: edge/memory/fit.py)

main.add_command(_plan_command, "plan")

from edge.cli.adapter_command import add_adapter as _add_adapter_command  # noqa: E402  (SUN: a running worker)

main.add_command(_add_adapter_command, "add-adapter")

try:  # the device roles (target / draft service over MQTT)
    from edge.cli.agent_run import run as _run_command

    main.add_command(_run_command, "run")
except ImportError as _e:  # only while the roles module is absent from a partial checkout
    if "edge.cli.agent_run" not in str(_e):
        raise


if __name__ == "__main__":
    main()
