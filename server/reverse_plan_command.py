"""`edge-hub plan`'s reverse-star part: which way each device joins (--device PROFILE) and the reverse
star's prediction (--hub-call-ms, --device-draft-ms), from server/reverse_planner.py."""
from __future__ import annotations

import click

from server.pairs_arg import pairs_arg

# the reference pair (docs/models.md): Qwen2.5-Coder-1.5B Q4_K_M target, 0.5B Q4_0 draft
TARGET_GB, DRAFT_GB, KV_GB = 1.117, 0.429, 0.5


def reverse_plan_options(f):
    opts = [
        click.option("--device", "devices", multiple=True, metavar="PROFILE",
                     help="a device of the star (devices/profiles/*.toml, repeatable): say which way it joins "
                          "-- it holds the target: StarSD; only the draft: the reverse star (edge-agent run "
                          "--role drafter)"),
        click.option("--target-gb", type=float, default=TARGET_GB, show_default=True,
                     help="the target's weights, GB (with --device)"),
        click.option("--draft-gb", type=float, default=DRAFT_GB, show_default=True,
                     help="the draft's weights, GB (with --device)"),
        click.option("--kv-gb", type=float, default=KV_GB, show_default=True,
                     help="KV and runtime room a device needs beside the weights, GB (with --device)"),
        click.option("--hub-call-ms", default=None, metavar="T=MS,...",
                     help="the reverse star: one call of the hub's target over T tokens in all (b sequences "
                          "x γ+1), ms, measured, e.g. 1=120,4=125,16=160,32=230"),
        click.option("--device-draft-ms", type=float, default=None,
                     help="the reverse star: one draft step on a drafting device, ms"),
        click.option("--prompt-tokens", type=int, default=0, show_default=True,
                     help="the reverse star: each generation's prompt, tokens, which the hub prefills ahead of "
                          "its batched verify, stalling the other devices' rounds (0: rounds only); give "
                          "--hub-call-ms a point near it, e.g. 200=2500"),
        click.option("--new-tokens", type=int, default=256, show_default=True,
                     help="the reverse star: tokens each generation produces (with --prompt-tokens)"),
    ]
    for o in reversed(opts):
        f = o(f)
    return f


def reverse_plan(o: dict, rtt_ms, alpha, ns: str, gammas: str, gamma) -> bool:
    """Print what the reverse options ask for; True when that is all `plan` was asked."""
    from server.reverse_planner import ReverseInputs, format_reverse, simulate_reverse, sweep_reverse

    if o["devices"]:
        click.echo(directions_table(o["devices"], o["target_gb"], o["draft_gb"], o["kv_gb"]))
    if o["hub_call_ms"] is None:
        return bool(o["devices"]) and alpha is None
    if o["device_draft_ms"] is None or alpha is None:
        raise click.UsageError("the reverse star's model needs --hub-call-ms, --device-draft-ms and --alpha "
                               "(and --rtt-ms, default 2)")
    inp = ReverseInputs(pairs_arg(o["hub_call_ms"], "--hub-call-ms", "T=MS"), o["device_draft_ms"],
                        2.0 if rtt_ms is None else rtt_ms, alpha)
    n_list = [int(x) for x in ns.split(",") if x.strip()]
    preds = ([simulate_reverse(inp, n, gamma) for n in n_list] if gamma else
             sweep_reverse(inp, n_list, [int(x) for x in gammas.split(",") if x.strip()]))
    click.echo(f"reverse star: hub call ms by tokens {inp.hub_call_ms}, device draft step "
               f"{inp.draft_step_ms:.1f} ms, rtt {inp.rtt_ms:.1f} ms, alpha {alpha:.2f}")
    click.echo(format_reverse(preds))
    if o["prompt_tokens"] > 0:
        click.echo(with_prompts(inp, preds, o["prompt_tokens"], o["new_tokens"]))
    return True


def with_prompts(inp, preds, prompt_tokens: int, new_tokens: int) -> str:
    """The same N and γ with every generation's prompt prefilled at the hub (server/reverse_schedule.py)."""
    from server.reverse_schedule import simulate_schedule, steady_jobs
    rows = [f"\nwith prompts of {prompt_tokens} tokens, {new_tokens} new tokens a generation (the hub prefills "
            "each prompt ahead of its batched verify):", "",
            "| N | γ | hub tok/s | per-device tok/s | vs plain | hub prefilling |", "|---|---|---|---|---|---|"]
    for p in preds:
        s = simulate_schedule(inp, steady_jobs(p.n, prompt_tokens, new_tokens), p.gamma)
        rows.append(f"| {p.n} | {p.gamma} | {s.hub_tps:.1f} | {s.per_device_tps:.2f} | "
                    f"{s.hub_tps / p.plain_tps:.2f}x | {s.prefill_s / s.wall_s:.0%} |")
    return "\n".join(rows)


def directions_table(profiles, target_gb: float, draft_gb: float, kv_gb: float) -> str:
    from devices.profile import load_profile
    from server.reverse_planner import choose_direction
    rows = ["| device | joins as | why |", "|---|---|---|"]
    for name in profiles:
        try:
            p = load_profile(name)
        except ValueError as e:
            raise click.BadParameter(str(e), param_hint="--device") from None
        way, why = choose_direction(p.usable_memory_gb * 1e9, target_gb * 1e9, draft_gb * 1e9, kv_gb * 1e9)
        role = {"target": "target (StarSD)", "drafter": "drafter (reverse)", "none": "-"}[way]
        rows.append(f"| {p.name} | {role} | {why} |")
    return "\n".join(rows)
