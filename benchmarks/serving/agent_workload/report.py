"""The run's report: markdown tables (BFCL accuracy, multi-turn TTFT, concurrent clients) and one
figure, from the result JSON (a partial run reports what it has)."""
from __future__ import annotations

import statistics
from pathlib import Path
from typing import List

from benchmarks.serving.agent_workload.options import CATEGORIES, MODELS, SERVERS
from benchmarks.serving.agent_workload.servers import STAR_CORE, TARGET_CORE


def _f(x, fmt="{:.2f}") -> str:
    return "-" if x is None else fmt.format(x)


def _short(model) -> str:
    return Path(str(model)).name


def _union(asked, stored, order) -> list:
    """asked + stored, each once, in `order` first (the canonical order), then as met."""
    every = list(dict.fromkeys(list(asked) + list(stored)))
    return [x for x in order if x in every] + [x for x in every if x not in order]


class Cells:
    """The result JSON read for the report: what was asked (config) and each cell's summary."""

    def __init__(self, d: dict):
        self.d, self.cfg, self.cells = d, d.get("config", {}), d.get("cells", {})
        # what the last run asked for and what earlier runs (or a run beside it) left in the record
        seen = [k.split("|") for k in self.cells]
        self.models = _union(self.cfg.get("models", list(MODELS)), [m for _, m, _ in seen], MODELS)
        self.servers = _union(self.cfg.get("servers", list(SERVERS)), [s for s, _, _ in seen], SERVERS)
        self.cats = self.cfg.get("categories", list(CATEGORIES))

    def cell(self, server, model, part) -> dict:
        return self.cells.get(f"{server}|{model}|{part}", {})

    def summ(self, server, model, part):
        c = self.cell(server, model, part)
        return c.get("summary") if c.get("done") else None

    def load(self, server, model, part) -> str:
        """The cell's 1-minute load average at its start and end (this machine is shared)."""
        la = self.cell(server, model, part).get("loadavg")
        return f"{la[0][0]:.1f}→{la[1][0]:.1f}" if la else "-"

    def partial(self, server, model, part) -> str:
        c = self.cell(server, model, part)
        rs = list(c.get("cases", {}).values())
        return f"({sum(r['ok'] for r in rs)}/{len(rs)} so far)" if rs and not c.get("done") else "-"


def header(v: Cells) -> List[str]:
    cfg, m = v.cfg, v.d.get("machine", {})
    par = v.d.get("ours_parallel")
    par = f" --parallel {par if isinstance(par, int) and not isinstance(par, bool) else cfg.get('clients')}" \
        if par else " (one generation at a time)"
    return [f"# Agent workloads: ours vs llama-server ({', '.join(_short(x) for x in v.models)})", "",
            f"CPU: {m.get('cpu')} ({m.get('cpus')} cpus). Every server on core {TARGET_CORE}, one thread, the same "
            f"GGUF; the star's hub + draft service ({cfg.get('draft')} as {cfg.get('draft_format')}) on core "
            f"{STAR_CORE}; the clients on core {STAR_CORE} (a run with --server-core 1 swaps the cores: each server's "
            f"`core` in the JSON). llama-server: `--jinja -t 1 -tb 1 -np {cfg.get('np')}`; "
            f"ours: the endpoint decoding alone{par}; ours-star: `edge-agent run --role target -g "
            f"{cfg.get('gamma')}{par}`. The machine is shared with other work: each timing row gives the 1-minute "
            "load average at the cell's start→end (2 cpus: above 2, the servers waited for a core)."]


def bfcl_table(v: Cells) -> List[str]:
    lines = ["", f"## BFCL tool calling: AST-checked accuracy ({v.cfg.get('cases')} cases a category, evenly "
                 f"spaced; tool_choice auto, parallel_tool_calls true, temperature 0; checker: "
                 f"{v.d.get('checker', 'benchmarks/lib/bfcl_check.py')})", "",
             "| model | server | " + " | ".join(v.cats) + " | replies without parsed calls | median s a case |",
             "|" + "---|" * (4 + len(v.cats))]
    for m in v.models:
        for s in v.servers:
            cols, no_calls, secs = [], 0, []
            for c in v.cats:
                x = v.summ(s, m, f"bfcl_{c}")
                cols.append(f"{x['passed']}/{x['n']} ({100 * x['accuracy']:.0f}%)" if x else v.partial(s, m, f"bfcl_{c}"))
                if x:
                    no_calls += x["no_calls"]
                    secs.append(x["median_s"])
            lines.append(f"| {_short(m)} | {s} | " + " | ".join(cols) + f" | {no_calls} | "
                         f"{_f(statistics.median(secs) if secs else None)} |")
    return lines


def multiturn_table(v: Cells) -> List[str]:
    turns, cfg = v.cfg.get("turns", 5), v.cfg
    lines = ["", f"## Multi-turn session: TTFT per turn (s, median of {cfg.get('sessions')} sessions; streamed, "
                 f"~{cfg.get('prefix_tokens')}-token system prompt, up to {cfg.get('turn_tokens')} tokens a turn)", "",
             "| model | server | " + " | ".join(f"turn {t + 1}" for t in range(turns))
             + " | session total s | prompt tokens (turn 1) | cached tokens per turn | load avg |",
             "|" + "---|" * (6 + turns)]
    for m in v.models:
        for s in v.servers:
            x = v.summ(s, m, "multiturn")
            if not x:
                lines.append(f"| {_short(m)} | {s} | " + " | ".join("-" for _ in range(turns)) + " | - | - | - | - |")
                continue
            lines.append(f"| {_short(m)} | {s} | " + " | ".join(_f(t) for t in x["ttft_s"])
                         + f" | {_f(x['total_s'])} | {x.get('prompt_tokens_turn1')} | "
                         + " / ".join("-" if t is None else str(t) for t in x["cached_tokens"])
                         + f" | {v.load(s, m, 'multiturn')} |")
    return lines


def interleaved_table(v: Cells) -> List[str]:
    """Only where a run had the interleaved part (it runs when asked for by name)."""
    rows = [(m, s, v.summ(s, m, "interleaved")) for m in v.models for s in v.servers]
    if not any(x for *_, x in rows):
        return []
    cfg = v.cfg
    lines = ["", f"## Interleaved conversations: {cfg.get('conversations')} conversations of 3 turns, round-robin "
                 f"(each ~{cfg.get('prefix_tokens')}-token system prompt its own; up to {cfg.get('turn_tokens')} tokens "
                 "a turn): TTFT per turn, the median over the conversations, and the prompt tokens reused", "",
             "| model | server | turn 1 TTFT s | turn 2 | turn 3 | prompt tokens (turn 1 / 2 / 3) | "
             "cached tokens (turn 1 / 2 / 3) | all turns s | load avg |",
             "|---|---|---|---|---|---|---|---|---|"]
    for m, s, x in rows:
        if x:
            lines.append(f"| {_short(m)} | {s} | " + " | ".join(_f(t) for t in x["ttft_s"]) + " | "
                         + " / ".join(_f(t, "{:.0f}") for t in x["prompt_tokens"]) + " | "
                         + " / ".join(_f(t, "{:.0f}") for t in x["cached_tokens"])
                         + f" | {_f(x['total_s'])} | {v.load(s, m, 'interleaved')} |")
    return lines


def concurrent_table(v: Cells) -> List[str]:
    cfg = v.cfg
    lines = ["", f"## {cfg.get('clients')} concurrent clients ({cfg.get('requests')} MT-bench requests each, "
                 f"up to {cfg.get('concurrent_tokens')} tokens, streamed), and the same requests from one client "
                 "one at a time on the same server (their ratio means something where their load averages are "
                 "alike; CPU ms a token: the server process's CPU seconds over the completion tokens, prefills "
                 "included (ours-star: its target process), which a busy machine inflates less than it does wall "
                 "time)", "",
             "| model | server | generations at once | total tok/s | CPU ms a token | p50 latency s | p99 latency s | "
             "TTFT p50 s | failed | load avg | one at a time: tok/s | CPU ms a token | TTFT p50 s | "
             "prompt tokens cached | load avg | concurrent / one at a time |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for m in v.models:
        for s in v.servers:
            x, one = v.summ(s, m, "concurrent"), v.summ(s, m, "serial")
            row = (f"{x['server_parallel']} | {_f(x['tok_s'])} | {_f(x.get('cpu_ms_per_token'), '{:.1f}')} | "
                   f"{_f(x['p50_s'])} | {_f(x['p99_s'])} | {_f(x['ttft_p50_s'])} | {x['failed']}/{x['requests']} | "
                   f"{v.load(s, m, 'concurrent')}" if x else "- | - | - | - | - | - | - | -")
            row += (f" | {_f(one['tok_s'])} | {_f(one.get('cpu_ms_per_token'), '{:.1f}')} | "
                    f"{_f(one.get('ttft_p50_s'))} | {_cached(one)} | {v.load(s, m, 'serial')}"
                    if one else " | - | - | - | - | -")
            ratio = x["tok_s"] / one["tok_s"] if x and one and one["tok_s"] else None
            lines.append(f"| {_short(m)} | {s} | {row} | {_f(ratio, '{:.2f}x')} |")
    return lines


def _cached(x: dict) -> str:
    """'cached of prompt tokens' over a cell's requests ('-' where the run did not record them)."""
    if not x.get("prompt_tokens"):
        return "-"
    return f"{x.get('cached_tokens') or 0} of {x['prompt_tokens']}"


def write_report(d: dict, out: Path) -> None:
    v = Cells(d)
    lines = header(v) + bfcl_table(v) + multiturn_table(v) + interleaved_table(v) + concurrent_table(v)
    errs = d.get("errors", [])
    if errs:
        lines += ["", "## Failures", ""] + [f"* {e['at']}: {e['error'][:300]}".replace("\n", " ") for e in errs]
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_name(out.name + ".md").write_text("\n".join(lines) + "\n")
    plot(v, out)


def plot(v: Cells, out: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    pairs = [(m, s) for m in v.models for s in v.servers]
    labels = [f"{_short(m).replace('qwen2.5-coder-', '')}\n{s}" for m, s in pairs]
    w = 0.8 / max(1, len(v.cats))
    for j, c in enumerate(v.cats):
        vals = [(v.summ(s, m, f"bfcl_{c}") or {}).get("accuracy", 0) * 100 for m, s in pairs]
        axes[0].bar([i + j * w for i in range(len(labels))], vals, w, label=c)
    axes[0].set_xticks([i + 0.4 - w / 2 for i in range(len(labels))], labels, fontsize=7)
    axes[0].set_ylabel("BFCL AST accuracy %")
    axes[0].legend(fontsize=7)
    for (m, s), (part, style) in [(p, k) for p in pairs for k in (("multiturn", "-"), ("interleaved", "--"))]:
        x = v.summ(s, m, part)
        if x:
            axes[1].plot(range(1, len(x["ttft_s"]) + 1), x["ttft_s"], marker="o", linestyle=style,
                         label=f"{_short(m).replace('qwen2.5-coder-', '')} {s}" + (" interleaved" if style == "--" else ""))
    axes[1].set_xlabel("turn")
    axes[1].set_ylabel("TTFT s (median)")
    if axes[1].lines:
        axes[1].legend(fontsize=7)
    axes[2].bar(range(len(labels)), [(v.summ(s, m, "concurrent") or {}).get("tok_s") or 0 for m, s in pairs])
    axes[2].set_xticks(range(len(labels)), labels, fontsize=7)
    axes[2].set_ylabel(f"total tok/s, {v.cfg.get('clients')} clients")
    fig.suptitle(f"agent workloads on {v.d.get('machine', {}).get('cpu')}", fontsize=9)
    fig.tight_layout()
    fig.savefig(out.with_name(out.name + ".png"), dpi=110)
    plt.close(fig)
