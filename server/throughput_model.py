"""`edge-hub plan`: the StarSD system model (server/planner.py) from measured or given inputs."""
from __future__ import annotations

import click

from server.pairs_arg import pairs_arg
from server.reverse_plan_command import reverse_plan, reverse_plan_options


@click.command()
@click.option("--measurements", type=click.Path(exists=True, dir_okay=False), default=None,
              help="JSON written by benchmarks/star/starsd_scaling.py  (its parts: benchmarks/lib/scaling_sweep.py): its measured inputs (flags below override)")
@click.option("--draft-step", default=None, metavar="B=MS,...",
              help="one batched draft step at batch size B, ms (measured), e.g. 1=40,4=55,16=120")
@click.option("--draft-feed-ms", type=float, default=None, help="per-request feed cost, ms")
@click.option("--profile", default=None, help="device profile of the targets (devices/profiles/*.toml)")
@click.option("--target-step-ms", type=float, default=None, help="one target decode step, ms")
@click.option("--verify-cost", default=None, metavar="K=COST,...",
              help="a target call over K tokens in single-step units, e.g. 1=1,3=1.05,5=1.1")
@click.option("--rtt-ms", type=float, default=None, help="network + protocol round trip, ms")
@click.option("--alpha", type=float, default=None, help="acceptance rate")
@click.option("--ns", default="1,2,4,8,16,32,64", show_default=True, help="numbers of targets")
@click.option("--gammas", default="1,2,3,4,5,6,8", show_default=True, help="γ values tried (best per N)")
@click.option("--gamma", type=int, default=None, help="fix γ instead of choosing the best")
@reverse_plan_options
def plan(measurements, draft_step, draft_feed_ms, profile, target_step_ms, verify_cost, rtt_ms, alpha, ns,
         gammas, gamma, **reverse):
    """Predict StarSD throughput vs N, N_full and the best γ (the system model of server/planner.py);
    with --device, which way each device joins; with --hub-call-ms, the reverse star (server/reverse_planner.py)."""
    import json

    if reverse_plan(reverse, rtt_ms, alpha, ns, gammas, gamma):
        return                            # only directions or the reverse model were asked for

    from server.planner import SystemInputs, format_table, simulate, sweep

    kw: dict = {}
    if measurements:
        try:
            got = json.loads(open(measurements).read())["planner"]["inputs"]
        except (ValueError, KeyError, TypeError):
            raise click.ClickException(f"{measurements} has no planner inputs: write it with "
                                       "benchmarks/star/starsd_scaling.py  (its parts: benchmarks/lib/scaling_sweep.py)") from None
        kw = {"draft_step_ms": {int(k): float(v) for k, v in got["draft_step_ms"].items()},
              "draft_feed_ms": got["draft_feed_ms"], "target_step_ms": got["target_step_ms"],
              "verify_cost": {int(k): float(v) for k, v in got["verify_cost"].items()},
              "rtt_ms": got["rtt_ms"], "alpha": got["alpha"]}
    if profile:
        from devices.profile import load_profile
        try:
            p = load_profile(profile)
        except ValueError as e:
            raise click.BadParameter(str(e), param_hint="--profile") from None
        wb, params = 1_117_320_768, 1.54e9        # Qwen2.5-Coder-1.5B Q4_K_M, the reference target
        kw["target_step_ms"] = p.call_ms(wb, params, 1)
        kw["verify_cost"] = {k: p.verify_cost(k, wb, params) for k in range(1, 34)}
    given = {"draft_step_ms": draft_step and pairs_arg(draft_step, "--draft-step"),
             "draft_feed_ms": draft_feed_ms, "target_step_ms": target_step_ms,
             "verify_cost": verify_cost and pairs_arg(verify_cost, "--verify-cost"), "rtt_ms": rtt_ms,
             "alpha": alpha}
    kw.update({k: v for k, v in given.items() if v is not None})
    kw.setdefault("draft_feed_ms", 0.0)
    kw.setdefault("rtt_ms", 2.0)
    missing = [f"--{k.replace('_ms', '').replace('_', '-')}" for k in
               ("draft_step_ms", "target_step_ms", "verify_cost", "alpha") if not kw.get(k) and kw.get(k) != 0]
    if missing:
        raise click.UsageError(f"missing {', '.join(missing)}: pass them, or --measurements FILE from "
                               "benchmarks/star/starsd_scaling.py  (its parts: benchmarks/lib/scaling_sweep.py) (and/or --profile for the target's costs)")
    if not 0.0 <= kw["alpha"] <= 1.0:
        raise click.BadParameter("must be in [0, 1]", param_hint="--alpha")
    try:
        n_list = [int(x) for x in ns.split(",") if x.strip()]
        g_list = [int(x) for x in gammas.split(",") if x.strip()]
    except ValueError:
        raise click.BadParameter("write comma-separated integers, e.g. 1,2,4,8") from None
    inp = SystemInputs(**kw)
    preds = [simulate(inp, n, gamma) for n in n_list] if gamma else sweep(inp, n_list, g_list)
    click.echo(f"draft step ms by batch {kw['draft_step_ms']}, target step {kw['target_step_ms']:.1f} ms, "
               f"rtt {kw['rtt_ms']:.1f} ms, alpha {kw['alpha']:.2f}")
    click.echo(format_table(preds))
