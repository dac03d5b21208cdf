"""benchmarks/star/reverse_star.py's outputs: the JSON as measured, a markdown table, a plot."""
from __future__ import annotations

import json
from pathlib import Path


def _engine(c: dict) -> str:
    return f"torch ({c['hub_dtype']})" if c.get("hub_backend") == "torch" else "llama.cpp"


def markdown(out: dict) -> str:
    m, c = out["machine"], out["config"]
    lines = [
        "# The reverse star: N drafting devices, one hub verifying in batch",
        "",
        f"Hub: {out['target']} on {_engine(c)}, one thread{'' if c['no_pin'] else ', core 1'}, inside `edge-hub serve "
        f"--verify-model` (Mosquitto). Devices{'' if c['no_pin'] else ' on core 0'}: the real device code over MQTT; "
        f"N = 1 calibrates with the real {out['draft']} draft (step {out['draft_step_ms']:.1f} ms), every N "
        f"replays its proposals at that step cost. γ = {c['gamma']}, {c['new']} greedy tokens per device, "
        f"{c['code']} code + {c['mtbench']} MT-bench prompts, medians of {c['rounds']} rounds. Plain batched: the "
        "same engine decoding N sequences, one batched call of N tokens a step, same core, after the hub stopped.",
        "",
        f"Commit {out['commit']}." if out.get("commit") else "",
        "",
        f"Machine: {m['cpu']} ({m['cpus']} cores, shared), load average {m['loadavg_start'][0]:.1f} at start, "
        f"{m['loadavg_end'][0]:.1f} at end. Planner inputs: acceptance α = {out['alpha']:.2f} (from N = 1's tokens "
        f"a round), round trip less the hub's call {out['rtt_ms']:.1f} ms (N = 1's replayed rounds, warm), "
        f"the hub's call by tokens {out['call_ms']} ms.",
        "",
        "| N | hub tok/s | per-device tok/s | plain batched hub tok/s | vs plain | predicted: rounds only | "
        "error | predicted: with prompts | error | tokens a round |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in out["rows"]:
        sched = (f"{r['sched_hub_tps']:.2f} | {100 * r['sched_error']:+.0f}%" if "sched_hub_tps" in r else "- | -")
        lines.append(f"| {r['n']} | {r['hub_tps']:.2f} | {r['per_device_tps']:.2f} | {r['plain_hub_tps']:.2f} | "
                     f"{r['vs_plain']:.2f}x | {r['pred_hub_tps']:.2f} | {100 * r['pred_error']:+.0f}% | {sched} | "
                     f"{r['tokens_per_round']:.2f} |")
    if out.get("prompt_alphas"):
        lines += ["", "Predicted, rounds only: server/reverse_planner.py's steady loop. With prompts: "
                  "server/reverse_schedule.py, each device's prompts as run here, the hub's prefill of each "
                  "(its call over the prompt, measured) and each prompt's acceptance from N = 1: "
                  + ", ".join(f"{k} tokens α = {v:.2f}" for k, v in sorted(out["prompt_alphas"].items(),
                                                                          key=lambda kv: int(kv[0]))) + "."]
    seen = [(n, p["hub_calls"]) for n, pts in out["points"].items() for p in pts[:1] if p.get("hub_calls")]
    if seen:
        lines += ["", "The serving hub's own batched verify calls in each N's first round, by sessions in the call "
                  "(calls × mean ms; prefills not included): " + "; ".join(
                      f"N = {n}: " + ", ".join(f"{b}: {c} × {ms:.0f}" for b, (c, ms) in sorted(
                          calls.items(), key=lambda kv: int(kv[0]))) for n, calls in seen) + "."]
    lines += ["", "Rates are of the decode on both sides, no prompt's prefill in either: the plain baseline times "
              "its decode steps only; the reverse star runs job k of every device together and times each "
              "generation from the last first answer of its group (every prompt of the group prefilled at the hub "
              "by then) to its end, counting the tokens committed after that. hub tok/s sums the devices' rates. "
              "Every N generates every prompt at least once, the baseline the same prompts in the same groups. "
              "The hub's verify service joins (edge/star/verify_join.py); both predictions model it.",
              "", f"Proposals not found for a context (a round with no drafts): {out['trace_misses']}. "
              f"Wall time {out['wall_s'] / 60:.1f} min.", ""]
    return "\n".join(lines)


def plot(out: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = out["rows"]
    ns = [r["n"] for r in rows]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(ns, [r["hub_tps"] for r in rows], "o-", label="reverse star (measured)")
    ax.plot(ns, [r["pred_hub_tps"] for r in rows], "s--", label="planner: rounds only")
    if all("sched_hub_tps" in r for r in rows):
        ax.plot(ns, [r["sched_hub_tps"] for r in rows], "d--", label="planner: with prompts")
    ax.plot(ns, [r["plain_hub_tps"] for r in rows], "^-", label="hub plain batched decoding")
    ax.set_xlabel("drafting devices N")
    ax.set_ylabel("hub tokens/s")
    ax.set_xscale("log", base=2)
    ax.set_xticks(ns, [str(n) for n in ns])
    ax.grid(alpha=0.3)
    ax.legend()
    ax.set_title(f"{out['target']}, γ={out['config']['gamma']}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_outputs(stem: Path, out: dict) -> None:
    stem.parent.mkdir(parents=True, exist_ok=True)
    stem.with_suffix(".json").write_text(json.dumps(out, indent=1, default=str))
    stem.with_suffix(".md").write_text(markdown(out))
    plot(out, stem.with_suffix(".png"))
