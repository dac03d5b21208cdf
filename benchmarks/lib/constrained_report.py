"""The tables and plot of benchmarks/star/constrained_speed.py: per mode over all prompts, per
prompt, and the grammar's cost beside the time a token takes. Results written before the
json_schema_no_jump / json_schema_nothing_forced modes existed render with the modes they have."""
from __future__ import annotations

import json
import statistics
from pathlib import Path

from benchmarks.lib.constrained_hostile import hostile_lines

MODES = ("unconstrained", "json_object", "json_schema", "json_schema_no_jump", "json_schema_nothing_forced")


def modes_of(rows: list, part: str = "star") -> tuple:
    return tuple(m for m in MODES if m in rows[0][part])


def overall(rows: list, part: str = "star") -> dict:
    """Per mode over all prompts: median of the per-prompt medians, and tokens / decode seconds summed."""
    out, modes = {}, modes_of(rows, part)
    for m in modes:
        rs = [r[part][m] for r in rows]
        out[m] = {"tok_s_median": statistics.median(x["tok_s"] for x in rs),
                  "tok_s_pooled": sum(x["tokens"] for x in rs) / sum(x["decode_s"] for x in rs),
                  "acceptance": statistics.median(x["acceptance"] for x in rs),
                  "tokens_per_round": statistics.median(x["tokens_per_round"] for x in rs),
                  "target_grammar_ms_per_token": statistics.median(x["target_grammar_ms_per_token"] for x in rs),
                  "draft_grammar_ms_per_token": statistics.median(x.get("draft_grammar_ms_per_token", 0.0)
                                                                  for x in rs),
                  "ms_per_token": statistics.median(1e3 / x["tok_s"] for x in rs if x["tok_s"] > 0),
                  "forced": statistics.median(x.get("forced", 0) for x in rs)}
    for m in modes[1:]:
        out[m]["ratio_median"] = statistics.median(r[part][m]["tok_s"] / r[part]["unconstrained"]["tok_s"]
                                                   for r in rows)
        out[m]["ratio_pooled"] = out[m]["tok_s_pooled"] / out["unconstrained"]["tok_s_pooled"]
    return out


def write(rows: list, meta: dict, out: Path) -> None:
    summary = {"star": overall(rows)}
    if meta["alone"]:
        summary["alone"] = overall(rows, "alone")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps({"meta": meta, "summary": summary, "rows": [
        {**r, "star": {m: {k: v for k, v in s.items()} for m, s in r["star"].items()}} for r in rows]}, indent=1))
    s, modes = summary["star"], modes_of(rows)
    lines = [f"# Constrained decoding through the star vs unconstrained ({meta['pair']})", "",
             f"CPU: {meta['cpu']}. Target {meta['target']} on core {meta['cores'][0]} (one llama.cpp thread); "
             f"the hub and a draft service ({meta['draft']}, one thread) on core {meta['cores'][1]}, Mosquitto. "
             f"Greedy, γ={meta['gamma']}, up to {meta['new_tokens']} new tokens, medians of {meta['rounds']} "
             f"per prompt and mode (the order rotating). {meta['time']}, {meta['wall_s'] / 60:.1f} min."
             + _load(meta), "",
             "## Over all prompts", "",
             "| mode | tok/s (median of prompts) | tok/s (pooled) | × unconstrained (median / pooled) | acceptance | "
             "tokens / round | forced tokens | ms / token | grammar ms / token: target | draft |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for m in modes:
        x = s[m]
        ratio = "1" if m == "unconstrained" else f"{x['ratio_median']:.3f} / {x['ratio_pooled']:.3f}"
        lines.append(f"| {m} | {x['tok_s_median']:.2f} | {x['tok_s_pooled']:.2f} | {ratio} | {x['acceptance']:.2f} | "
                     f"{x['tokens_per_round']:.2f} | {x.get('forced', 0):.0f} | {x['ms_per_token']:.1f} | "
                     f"{x['target_grammar_ms_per_token']:.3f} | {x['draft_grammar_ms_per_token']:.3f} |")
    lines += ["", "## Per prompt", "",
              "| prompt | mode | tok/s | × unc. | acceptance | rounds | alone | draft round trip ms | tokens | "
              "forced | tokens / round | grammar ms/token target | draft | draft mask µs each | valid JSON | "
              "same text every run |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        for m in modes:
            x = r["star"][m]
            ratio = "" if m == "unconstrained" else f"{r['ratio'][m]:.3f}"
            valid = "" if m == "unconstrained" else {None: "cut at --new", True: "yes", False: "**no**"}[x["valid"]]
            trips = f"{x['alone']:.0f} | {x['rtt_ms']:.1f}" if "alone" in x else " | "
            lines.append(f"| {r['prompt']} | {m} | {x['tok_s']:.2f} | {ratio} | {x['acceptance']:.2f} | "
                         f"{x['rounds']:.0f} | {trips} | {x['tokens']:.0f} | {x.get('forced', 0):.0f} | "
                         f"{x['tokens_per_round']:.2f} | "
                         f"{x['target_grammar_ms_per_token']:.3f} | {x.get('draft_grammar_ms_per_token', 0):.3f} | "
                         f"{x.get('draft_mask_us_each', 0):.0f} | {valid} | {'yes' if x['same_text'] else 'no'} |")
    if meta["alone"]:
        a = summary["alone"]
        lines += ["", "## Target alone (no draft), one run per prompt and mode", "",
                  "| mode | tok/s (median of prompts) | × unconstrained (median) | grammar ms / token |",
                  "|---|---|---|---|"]
        for m in modes:
            ratio = "1" if m == "unconstrained" else f"{a[m]['ratio_median']:.3f}"
            lines.append(f"| {m} | {a[m]['tok_s_median']:.2f} | {ratio} | {a[m]['target_grammar_ms_per_token']:.3f} |")
    worst = min(s[m]["ratio_median"] for m in modes[1:])
    mask = max(s[m]["target_grammar_ms_per_token"] + s[m]["draft_grammar_ms_per_token"] for m in modes[1:])
    lines += ["", "## Reading it", ""] + _jump_reading(s, modes) + [
              f"Goal (issue 36): constrained within 10% of unconstrained, i.e. × ≥ 0.90. Worst mode here: "
              f"{worst:.3f} (median of the per-prompt ratios). The grammar itself costs at most {mask:.3f} ms a "
              f"token on both sides together, against {s['unconstrained']['ms_per_token']:.1f} ms a token "
              "unconstrained: what separates the modes beyond that is the text each produces (its length, how "
              "well the draft predicts it: acceptance, tokens a round), not the mask.",
              "", "Texts (last run):", ""]
    for r in rows:
        for m in modes:
            lines.append(f"* {r['prompt']} / {m}: `{r['star'][m]['text'][:160]!r}`")
    lines += hostile_lines(meta.get("hostile"))
    lines += ["", f"Command: `{meta['command']}`"]
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(11, 4))
    xs = range(len(rows))
    w = 0.8 / len(modes)
    for i, m in enumerate(modes):
        ax.bar([x + (i - (len(modes) - 1) / 2) * w for x in xs], [r["star"][m]["tok_s"] for r in rows], w, label=m)
    ax.set_xticks(list(xs), [r["prompt"] for r in rows], fontsize=8)
    ax.set_ylabel("tok/s through the star (median)")
    ax.legend(fontsize=8)
    ax.set_title(f"Same prompts, {len(modes)} modes")
    w = 0.8 / (len(modes) - 1)
    for i, m in enumerate(modes[1:]):
        bx.bar([x + (i - (len(modes) - 2) / 2) * w for x in xs], [r["ratio"][m] for r in rows], w, label=m,
               color=f"C{i + 1}")
    if "json_schema_no_jump" in modes:
        bx.axhline(1.0, color="red", ls="--", lw=1, label="goal (#44): json_schema ≥ 1.0")
    bx.axhline(0.9, color="red", ls=":", lw=1, label="goal (#36): 0.90")
    bx.axhline(1.0, color="grey", lw=0.8)
    bx.set_xticks(list(xs), [r["prompt"] for r in rows], fontsize=8)
    bx.set_ylabel("tok/s constrained / unconstrained")
    bx.legend(fontsize=8)
    bx.set_title("Ratio")
    fig.tight_layout()
    fig.savefig(out.with_suffix(".png"), dpi=100)
    print("\n".join(lines))


def _jump_reading(s: dict, modes: tuple) -> list:
    """What jump-forward (and forced drafts) did, where the run has json_schema with and without."""
    if "json_schema_no_jump" not in modes:
        return []
    on, off = s["json_schema"], s["json_schema_no_jump"]
    lines = [f"Goal (issue 44): json_schema ≥ 1.0× unconstrained, thanks to forced tokens. Here json_schema is "
             f"{on['ratio_median']:.3f}× (pooled {on['ratio_pooled']:.3f}×) with jump-forward and "
             f"{off['ratio_median']:.3f}× (pooled {off['ratio_pooled']:.3f}×) with it off (same grammar, same run): "
             f"jump-forward {on['tok_s_pooled'] / off['tok_s_pooled']:.3f}× pooled tok/s, "
             f"{on['tokens_per_round']:.2f} vs {off['tokens_per_round']:.2f} tokens a target call, "
             f"{on['forced']:.0f} forced tokens an answer (median)."]
    if "json_schema_nothing_forced" in modes:
        no = s["json_schema_nothing_forced"]
        lines[0] += (f" With nothing forced (no jump-forward, forced drafts counted against γ) it is "
                     f"{no['ratio_median']:.3f}× (pooled {no['ratio_pooled']:.3f}×), {no['tokens_per_round']:.2f} "
                     f"tokens a target call: forced tokens {on['tok_s_pooled'] / no['tok_s_pooled']:.3f}× pooled tok/s.")
    return lines + [""]


def _load(meta: dict) -> str:
    if "load_avg_before" not in meta:
        return ""
    return (f" 1-minute load average {meta['load_avg_before'][0]:.1f} before, {meta['load_avg_after'][0]:.1f} "
            f"after (2 cores: above 2, other work shared them).")
