"""benchmarks/star/starsd_two_device.py's report: the passes' medians, the table, the plot.

`merge_passes` folds one prompt's rows from several passes (a learning draft runs each prompt
once a pass) into medians, keeping each pass's own speedup; `write` writes
<out>.json / .md / .png, one column group and one bar series a γ mode.
"""
from __future__ import annotations

import json
import platform
import statistics

from edge.telemetry.cpu_info import cpu_name


def merge_passes(rows, gammas) -> dict:
    """One prompt's rows from several passes: medians; each pass's speedup is its own star run over
    its own alone run (side by side), and the row keeps them all ('speedups')."""
    med = statistics.median
    out = dict(rows[0], alone_tok_s=med(r["alone_tok_s"] for r in rows),
               step_ms=med(r["step_ms"] for r in rows if r["step_ms"]) if any(r["step_ms"] for r in rows) else None)
    for g in gammas:
        xs = [r[f"g{g}"] for r in rows]
        split = [x for x in xs if not x["same_text"]]
        m = {k: med(x[k] for x in xs) for k in ("tok_s", "speedup", "acceptance", "tokens_per_verify",
                                                 "wait_overhead_ms", "wait_per_draft_ms")}
        m.update(gamma_mean=statistics.mean(x["gamma_mean"] for x in xs),
                 sent_mean=statistics.mean(x.get("sent_mean", float("nan")) for x in xs),
                 gamma_zero_share=statistics.mean(x["gamma_zero_share"] for x in xs),
                 speedups=[x["speedup"] for x in xs], same_text=not split,
                 split_at=min(x["split_at"] for x in split) if split else None,
                 margin_at_split=min(split, key=lambda x: x["split_at"])["margin_at_split"] if split else None)
        out[f"g{g}"] = m
    return out


def write(rows, gammas, args) -> None:
    res = {"machine": platform.machine(), "cpu": cpu_name(), "target": args.target,
           "target_format": args.target_format, "draft": args.draft, "draft_format": args.draft_format,
           "new_tokens": args.new, "rounds": args.rounds,
           "star_rounds": args.star_rounds, "passes": args.passes, "threads_per_device": 1, "ahead": args.ahead,
           "drafter": args.drafter, "draft_p_min": args.draft_p_min,
           "setup": getattr(args, "setup", None) or "target on core 0 (this process); hub + remote draft service "
                    f"({args.drafter}) on core 1; Mosquitto; memory bandwidth shared", "rows": rows}
    for g in gammas:
        res[f"median_speedup_g{g}"] = statistics.median(r[f"g{g}"]["speedup"] for r in rows)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(res, indent=1))
    head = "| set | prompt | alone tok/s | " + " | ".join(
        f"γ={g} tok/s | × | accept | tok/verify | mean γ | sent | split (margin)" for g in gammas) + " |"
    fmt = "" if args.target_format == "native" else f" stored as {args.target_format}"
    dfmt = "" if args.draft_format == "native" else f" stored as {args.draft_format}"
    lines = [f"# StarSD on two cores as two devices: {args.target}{fmt} target (core 0), {args.draft}{dfmt} remote "
             f"draft (core 1), {args.new} greedy tokens, " + (
                 f"medians of {args.rounds}" if args.star_rounds == args.rounds else
                 f"medians of {args.passes} passes, each with a fresh hub and draft service, a prompt run once "
                 f"a pass alone and once through the star (the {args.drafter} draft's fleet tree learns every "
                 f"session's output: it holds the earlier prompts', never this prompt's own); × is the median "
                 f"of the passes' own ratios, their range in brackets" if args.passes > 1 else
                 f"target alone: medians of {args.rounds}; the star: one run a prompt (the {args.drafter} "
                 f"draft's fleet tree learns every session's output: it holds the earlier prompts', never "
                 f"this prompt's own)"), "",
             f"Draft service: --drafter {args.drafter}, --draft-p-min "
             f"{'(edge-agent run default)' if args.draft_p_min is None else args.draft_p_min}, "
             f"draft-ahead {'on' if args.ahead else 'off'}.", "",
             f"CPU: {res['cpu']}. Memory bandwidth is shared between the two cores.", "", head,
             "|" + "---|" * (3 + 7 * len(gammas))]
    for r in rows:
        cells = [r["kind"], r["prompt"].replace("|", "/").replace("\n", " "), f"{r['alone_tok_s']:.2f}"]
        for g in gammas:
            x = r[f"g{g}"]
            split = "same text" if x["same_text"] else f"at {x['split_at']} ({x['margin_at_split']:.2f})"
            sp = x.get("speedups")
            cells += [f"{x['tok_s']:.2f}", f"{x['speedup']:.2f}" + (f" ({min(sp):.2f}–{max(sp):.2f})" if sp else ""),
                      f"{x['acceptance']:.2f}",
                      f"{x['tokens_per_verify']:.2f}", f"{x['gamma_mean']:.1f}", f"{x.get('sent_mean', float('nan')):.1f}",
                      split]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "mean γ: drafts asked a round; sent: drafts the service sent a round that asked (its "
              "confidence stop, --draft-p-min, ends an answer early)", ""]
    lines += [f"Median speedup at γ={g}: **{res[f'median_speedup_g{g}']:.2f}×**" for g in gammas]
    for kind in dict.fromkeys(r["kind"] for r in rows):       # per prompt set: median and worst
        for g in gammas:
            sp = [r[f"g{g}"]["speedup"] for r in rows if r["kind"] == kind]
            lines.append(f"- {kind}, γ={g}: median {statistics.median(sp):.2f}×, worst {min(sp):.2f}×")
    args.out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(8, 3.5))
    xs = range(len(rows))
    w = 0.8 / (1 + len(gammas))                          # one bar a series, side by side
    ax.bar([x - 0.4 + w / 2 for x in xs], [r["alone_tok_s"] for r in rows], w, label="target alone")
    for i, g in enumerate(gammas, 1):
        ax.bar([x - 0.4 + w / 2 + i * w for x in xs], [r[f"g{g}"]["tok_s"] for r in rows], w, label=f"StarSD γ={g}")
    ax.set_xticks(list(xs), [f"{r['kind']}{i}" for i, r in enumerate(rows)])
    ax.set_ylabel("tok/s (median)")
    ax.legend()
    ax.set_title("StarSD, cores as devices")
    fig.tight_layout()
    fig.savefig(args.out.with_suffix(".png"), dpi=120)
    print("\n".join(lines))
