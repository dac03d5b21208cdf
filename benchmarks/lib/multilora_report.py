"""The markdown and the plot of benchmarks/sun/sun_vs_multilora.py, from its JSON (whatever cells are done)."""
from __future__ import annotations

from pathlib import Path

from benchmarks.lib.multilora_plan import cell_key, table
from benchmarks.lib.sun_prefill_counts import prefill_lines


def goals(cells: dict, counts) -> list:
    """The issue's goals, as measured: SUN >= 1.3x llama-server's tok/s at the largest task count with
    <= its memory (peak RSS and PSS), and no worse (>= 1.0x) at the smallest."""
    out = []
    for n, need in ((max(counts), 1.3), (min(counts), 1.0)):
        s = cells.get(cell_key("sun", "sun-lora", n), {})
        l = cells.get(cell_key("llama-server", "sun-lora", n), {})
        if not (s.get("summary") and l.get("summary")):
            out.append(f"* {n} tasks: not measured yet")
            continue
        r = s["summary"]["tok_s"] / l["summary"]["tok_s"] if l["summary"]["tok_s"] else float("nan")
        mem = {k: (s["memory"][k], l["memory"][k]) for k in ("peak_rss_sum", "peak_pss_sum")}
        mem_ok = all(a <= b for a, b in mem.values())
        out.append(f"* {n} tasks: SUN {r:.2f}x llama-server's tok/s (goal >= {need}x: "
                   f"{'met' if r >= need else 'NOT met'}); memory peak RSS {mem['peak_rss_sum'][0] / 2**20:.0f} vs "
                   f"{mem['peak_rss_sum'][1] / 2**20:.0f} MiB, PSS {mem['peak_pss_sum'][0] / 2**20:.0f} vs "
                   f"{mem['peak_pss_sum'][1] / 2**20:.0f} MiB" + ("" if n != max(counts) else
                                                                  f" (goal <=: {'met' if mem_ok else 'NOT met'})"))
    return out


def sun_setup(cfg: dict) -> str:
    threads = (cfg.get("sun_threads") or "?,?").split(",")
    if cfg.get("split", True):        # the first record ran split (its config has no "split")
        return (f"hub (Mosquitto, router, OpenAI endpoint, shared decoder, {threads[-1]} thread, --sun-max-batch "
                f"{cfg.get('slots')}) + one prefill worker with every adapter ({threads[0]} thread).")
    return (f"hub (Mosquitto, router, OpenAI endpoint, --sun-grammars-on-demand) + ONE `edge-agent run --role prefill "
            f"--with-decoder --grammars-on-demand --max-batch {cfg.get('slots')} --threads {threads[0]}`: every adapter "
            "and the shared decoder over one load of the base in one process (the decoder on a second llama.cpp "
            "context of the same model, one thread each; prefill one row a step).")


def _workload_said(cfg: dict) -> str:
    if cfg.get("workload") == "code":
        return ("HumanEval (a chat turn: 'Complete the following Python function', the problem's prompt; "
                "decode-heavy; the adapters are the tools ones)")
    return "held-out BFCL"


def markdown(d: dict) -> str:
    cfg, m, cells = d.get("config", {}), d.get("machine", {}), d.get("cells", {})
    counts = cfg.get("task_counts") or [8, 64]
    loads = [c.get("loadavg_before", [None])[0] for c in cells.values() if c.get("summary")]
    lines = [
        "# SUN vs llama-server multi-LoRA: the same base GGUF, the same GGUF LoRA files",
        "",
        f"Machine: {m.get('cpu')} ({m.get('cpus')} CPUs, host {m.get('host')}); 1-minute load average at each cell's "
        f"start: {', '.join(f'{x:.1f}' for x in loads if x is not None) or 'n/a'} (the cores are shared with other "
        "engineers' work: compare the two sides of one task count, run back to back, not rows across counts).",
        "",
        f"Base: `{d.get('base_gguf')}` (Qwen2.5-Coder-0.5B-Instruct, the SUN bundle's Q4_0 GGUF) on both sides. "
        f"Burst: {cfg.get('requests')} streamed greedy chat requests at once, at most {cfg.get('max_tokens')} new "
        f"tokens, Zipf(1.1) task popularity, request r on {_workload_said(cfg)} item r mod {d.get('items')}. Both sides "
        f"pinned with `taskset -c {cfg.get('cores')}`; llama-server `-t {cfg.get('threads')} -tb {cfg.get('threads')} "
        f"-np {cfg.get('slots')} -c {cfg.get('slots', 0) * cfg.get('ctx', 0)} -cram 0 --jinja --lora ...` with the "
        f"per-request `lora` field (every adapter's scale explicit); SUN: {sun_setup(cfg)}",
        "",
        *table(cells),
        "",
        "Goals (issue 45):",
        *goals(cells, counts),
        "",
        *(["SUN prefills per request (from the processes' logs; a request sent again under a new id is "
           "prefilled again):", *prefill_lines(cells), ""] if prefill_lines(cells) else []),
        *(["What this run says (written after it, kept in the JSON's \"notes\"):", *d["notes"], ""]
          if d.get("notes") else []),
        "Adapters (rank / steps / loss of each tuned one; task i's file is a copy of tuned adapter i mod K):",
        *[f"* {kind}: " + "; ".join(f"{t['dir']} ({t['kind']}, {t['steps']} steps of {t['batch_size']}, lr {t['lr']}, "
                                     f"last {t['last']})" for t in recs)
          for kind, recs in (d.get("tuned") or {}).items() if recs],
        "",
        "Columns: tok/s = completion tokens of the burst / its wall time; TTFT from the burst's start (queueing "
        "included); peak RSS / PSS = the largest sum over the side's processes sampled every 0.2 s (PSS counts pages "
        "shared between processes once); accuracy = " + ("the answer's function passes the HumanEval problem's tests"
                                                         if cfg.get("workload") == "code" else
                                                         "the BFCL AST check on the answers") + " (items scored).",
    ]
    return "\n".join(lines) + "\n"


def plot(d: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    cells = [c for c in d.get("cells", {}).values() if c.get("summary")]
    if not cells:
        return
    labels = [f"{c['side']}\n{c['adapters']}, {c['n_tasks']} tasks" for c in cells]
    colours = ["tab:orange" if c["side"] == "sun" else "tab:blue" for c in cells]
    panels = (("tok/s", lambda c: c["summary"]["tok_s"] or 0),
              ("TTFT p99 (s)", lambda c: c["summary"]["ttft_p99_s"] or 0),
              ("peak RSS (MiB)", lambda c: c["memory"]["peak_rss_sum"] / 2**20),
              ("accuracy", lambda c: c["summary"]["accuracy"] or 0))
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 4.2))
    for ax, (title, f) in zip(axes, panels):
        ax.bar(range(len(cells)), [f(c) for c in cells], color=colours)
        ax.set_xticks(range(len(cells)), labels, rotation=60, ha="right", fontsize=7)
        ax.set_title(title)
    fig.suptitle("SUN (orange) vs llama-server multi-LoRA (blue), Qwen2.5-Coder-0.5B Q4_0")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_report(d: dict, stem: Path) -> None:
    stem.parent.mkdir(parents=True, exist_ok=True)
    stem.with_suffix(".md").write_text(markdown(d))
    plot(d, stem.with_suffix(".png"))
