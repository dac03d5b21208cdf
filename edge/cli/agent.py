"""`edge-agent`: run a role on a device, or generate locally with speculative decoding."""
from __future__ import annotations

import sys
from pathlib import Path

import click

from edge.cli.options import adaptive_refusal, apply, backend_option, gamma_option, model_options, verbose_option
from edge.cli.sections import GENERATION, MODEL, SectionedCommand, option
from edge.cli.startup import open_model_for_command

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


def run_generation(target_spec, draft_spec, prompt, gamma, max_new, temperature, top_k, top_p,
                   seed, chat, compare, dtype, threads, max_len, backend="auto",
                   draft_backend=None, draft_top_k=64, device="auto", gpu_layers=None):
    """gamma: (γ, adaptive) as --gamma reads it: the fixed γ, or the largest one a policy picks from.
    device / gpu_layers: where both models run (edge/engines/placement.py)."""
    from edge.speculative.generate import ModelDrafter, generate_plain, generate_speculative
    from edge.speculative.ngram import NgramDrafter
    from edge.speculative.sampling import SamplingParams

    gamma, adaptive = gamma
    target, tok = open_model_for_command(target_spec, dtype, threads, max_len, backend, device=device,
                                         gpu_layers=gpu_layers)
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
    if draft_spec == "ngram":
        drafter, draft_name = NgramDrafter(), "n-gram prompt lookup"
    elif draft_spec == "suffix":
        from edge.speculative.suffix_drafter import SuffixDrafter
        drafter, draft_name = SuffixDrafter(), "suffix trees (prompt + output)"
    else:
        draft, dtok = open_model_for_command(draft_spec, dtype, threads, max_len, draft_backend or backend,
                                             device=device, gpu_layers=gpu_layers)
        if dtok.fingerprint() != tok.fingerprint():
            raise click.ClickException(
                "draft and target use different tokenizers (fingerprints "
                f"{dtok.fingerprint()[:12]} vs {tok.fingerprint()[:12]}); speculative decoding "
                "needs the same vocabulary: pick a draft from the target's family")
        drafter, draft_name = ModelDrafter(draft, params, top_k=draft_top_k), Path(draft_spec).name
    text = tok.apply_chat_template([{"role": "user", "content": prompt}]) if chat else prompt
    ids = tok.encode(text)
    if len(ids) + max_new > target.max_len:
        raise click.ClickException(f"the prompt has {len(ids)} tokens; with {max_new} new tokens it "
                                   f"exceeds the context of {target.max_len}: shorten it or lower --max-new")
    stops = tuple(tok.eos_ids)
    click.echo(f"--- speculative: draft {draft_name}, γ={f'auto:{gamma}' if adaptive else gamma} ---", err=True)
    spec = generate_speculative(target, drafter, ids, max_new, gamma, params, stop_ids=stops,
                                on_token=streamer(tok), adaptive=adaptive)
    click.echo("")
    rows = [("speculative", spec)]
    if compare:
        click.echo("--- target alone ---", err=True)
        plain = generate_plain(target, ids, max_new, params, stop_ids=stops, on_token=streamer(tok))
        click.echo("")
        rows.append(("target alone", plain))
    from edge.speculative.speedup_note import speedup_note
    why = speedup_note(spec, rows[1][1] if compare else None, drafter.policy if adaptive else None, gamma)
    report(rows, greedy=temperature == 0, why=why)
    return rows


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
    ])


@main.command(cls=SectionedCommand)
@click.argument("prompt")
@option(MODEL, "--target", "-T", default=DEFAULT_TARGET, show_default=True, help="model name or path")
@option(MODEL, "--draft", "-D", default=DEFAULT_DRAFT, show_default=True,
        help="draft model name/path, 'ngram' for prompt lookup or 'suffix' for suffix trees (no model)")
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
