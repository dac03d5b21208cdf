"""Markdown table and PNG of benchmarks/sun/sun_adapters.py's llama.cpp rows."""
from __future__ import annotations

from pathlib import Path

import numpy as np

MODES = ("adapters", "full_copies")


def llamacpp_markdown(res: dict, meta: dict) -> str:
    runs, m = res["runs"], res["micro"]
    lines = ["# SUN prefill on llama.cpp: GGUF LoRA adapters in one worker vs full copies under the same memory", "",
             f"llama.cpp (llama-cpp-python), {meta['threads']} thread, base {meta['base']}, rank-16 GGUF LoRA "
             f"adapters ({meta['adapter_type']}, all seven linears), a burst of requests with Zipf(1.1) task "
             "popularity; medians of "
             f"{meta['reps']} interleaved repetitions per mode. Process pinned to CPUs {meta['cpus_allowed']}, "
             f"nice {meta['nice']}; machine: {meta['machine']} -- compare the two modes of a row, not rows "
             "across runs. Full copies: as many llama.cpp workers as the adapter worker's weight memory holds "
             "(base + T adapter files), each reading its model into its own memory; a task without a resident "
             "copy evicts the least recently used one (stand-in for a task's merged GGUF: the base file, same "
             "tensors, types and bytes, so the same load and prefill time). Prefill only; the KV hand-over "
             "(identical in both modes) is not timed.", "",
             "| tasks | requests x tokens | budget | full copies fit | mode | calls | adapter switches | "
             "copy loads | tok/s | tok per CPU s | TTFT p50 | TTFT p99 | adapters / full copies (tok/s; per CPU s) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in runs:
        for mode in MODES:
            x = r[mode]
            ratio = f"{r['tok_s_ratio']:.2f}x; {r['tok_per_cpu_s_ratio']:.2f}x" if mode == "adapters" else ""
            sw = x.get("switches", "")
            lines.append(f"| {r['tasks']} | {r['requests']} x {r['prompt_len']} | {r['budget_bytes'] / 1e6:.0f} MB | "
                         f"{r['full_copies_fit']} | {mode.replace('_', ' ')} | {x['calls']} | {sw} | {x['loads']} | "
                         f"{x['tok_s']:.0f} | {x['tok_per_cpu_s']:.0f} | {x['ttft_p50_ms']:.0f} ms | {x['ttft_p99_ms']:.0f} ms | {ratio} |")
    lines += ["", f"Per-call costs on one context ({m['prompt_len']}-token prefill, medians of {m['reps']} "
              "interleaved rounds; CPU = this process's CPU time, which the other work on the shared cores "
              "inflates least):", "", "| what | wall ms | CPU ms |", "|---|---|---|"]
    for label, key in (("prefill, bare base", "prefill_base"),
                       ("prefill, one adapter kept active", "prefill_adapter_kept"),
                       ("prefill, adapter switched just before", "prefill_adapter_switched"),
                       ("= adapter switch (set + graph rebuild at the next decode)", "switch_ms"),
                       ("= LoRA matmuls in a prefill", "lora_compute_ms"),
                       ("llama_set_adapters_lora call alone", "set_adapters_call"),
                       (f"{m['group_rows']} rows of one task, one llama_decode per row (what the worker does)",
                        "group_one_decode_per_row"),
                       ("the same rows in ONE llama_decode (one seq id per row)", "group_one_decode"),
                       ("loading a full copy (model + context, no mmap)", "full_copy_load")):
        lines.append(f"| {label} | {m[key]['wall_ms']:.2f} | {m[key]['cpu_ms']:.2f} |")
    return "\n".join(lines) + "\n"


def llamacpp_plot(runs: list, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    x = np.arange(len(runs))
    for i, mode in enumerate(MODES):
        for ax, key in zip(axes, ("tok_s", "ttft_p50_ms", "ttft_p99_ms")):
            ax.bar(x + (i - 0.5) * 0.4, [r[mode][key] for r in runs], 0.4, label=mode.replace("_", " "))
    for ax, title in zip(axes, ("prefill tok/s", "TTFT p50 (ms)", "TTFT p99 (ms)")):
        ax.set_xticks(x, [f"{r['tasks']} tasks ({r['full_copies_fit']} copies fit)" for r in runs])
        ax.set_title(title)
        ax.legend(fontsize=8)
    fig.suptitle("SUN prefill on llama.cpp, same memory: one worker with GGUF LoRA adapters vs full copies "
                 "(SmolLM2-135M Q4_1, 1 thread)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
