"""Local speculative decoding on one machine: ours vs the peers, same pair, prompts and run.

Qwen2.5-Coder 0.5B drafts for 1.5B on MT-bench first turns, greedy. Modes:
target-only, speculative γ ∈ --gammas, adaptive γ, n-gram prompt lookup; for
each backend of ours (torch, llama.cpp) and for the peers (llama-cpp-python's
own speculative API, Hugging Face assisted generation). Every speedup is
against the same system's own target-only run on the same prompt, medians
over prompts. Also measures the cost model's inputs (verify cost vs k, draft
cost ratio c) and prints its predicted speedup next to the measured one.

  python -m benchmarks.speculative.local_spec --prompts 8 --max-new 64      # ~1 h on 2 busy cores
Run from the repository root. Writes benchmarks/results/local_spec/<variant>.{json,png,md}
(--out; default: the variant `default`).
"""
from __future__ import annotations

import argparse
import gc
import json
import platform
import statistics
import time
from pathlib import Path

import numpy as np

from benchmarks.lib.datasets import mtbench_first_turns
from benchmarks.lib.results import result_stem
from edge.model.fetch import model_path
from edge.speculative.generate import ModelDrafter, generate_plain, generate_speculative
from edge.speculative.ngram import NgramDrafter
from edge.speculative.sampling import SamplingParams
from edge.speculative.verify import predicted_speedup

GREEDY = SamplingParams(temperature=0.0)


def load_ours(backend: str, name: str, threads: int):
    if backend == "torch":
        import torch

        from edge.model.checkpoint import load_model
        from edge.engines.torch_engine import TorchEngine
        model, ck = load_model(model_path(name), dtype=torch.float32)
        return TorchEngine(model, ck.fingerprint, threads=threads, max_len=2048), ck.tokenizer
    from edge.engines.llamacpp_engine import LlamaCppEngine
    from edge.model.tokenizer import Tokenizer
    return (LlamaCppEngine(model_path(name), max_len=2048, n_seq_max=2, threads=threads),
            Tokenizer.from_gguf(model_path(name)))


def measure_costs(target, draft, ks=(1, 2, 3, 4, 5, 7, 9)):
    """Median seconds of one target call over k tokens, and of one draft step."""
    seq = target.new_sequence()
    target.forward(seq, list(range(100, 164)))
    t_call = {}
    for k in ks:
        ts = []
        for _ in range(5):
            t0 = time.perf_counter()
            target.forward(seq, list(range(200, 200 + k)))
            ts.append(time.perf_counter() - t0)
            target.truncate(seq, 64)
        t_call[k] = statistics.median(ts)
    target.free(seq)
    d = draft.new_sequence()
    draft.forward(d, list(range(100, 164)))
    ts = []
    for _ in range(7):
        t0 = time.perf_counter()
        draft.forward(d, [300])
        ts.append(time.perf_counter() - t0)
        draft.truncate(d, 64)
    draft.free(d)
    return t_call, statistics.median(ts)


def e2e(r):
    """End-to-end tokens/s, prefill included: what the peers' timings measure too."""
    return r.n_generated / r.wall_s


def run_ours(backend, prompts, args):
    target, tok = load_ours(backend, "qwen2.5-coder-1.5b", args.threads)
    draft, _ = load_ours(backend, "qwen2.5-coder-0.5b", args.threads)
    t_call, t_draft = measure_costs(target, draft)
    v = {k: t / t_call[1] for k, t in t_call.items()}
    c = t_draft / t_call[1]
    rows = []
    for i, text in enumerate(prompts):
        ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": text}]))
        stops = tuple(tok.eos_ids)
        base = generate_plain(target, ids, args.max_new, GREEDY, stop_ids=stops)
        rows.append(dict(system=f"ours-{backend}", mode="target-only", prompt=i, tps=e2e(base),
                         ratio=1.0, accept=None, tpv=1.0, same=True))
        modes = [(f"γ={g}", ModelDrafter(draft, GREEDY), g, False) for g in args.gammas]
        modes += [("adaptive", ModelDrafter(draft, GREEDY), max(args.gammas), True),
                  ("ngram γ=3", NgramDrafter(), 3, False)]
        for name, drafter, g, adaptive in modes:
            r = generate_speculative(target, drafter, ids, args.max_new, g, GREEDY, stop_ids=stops,
                                     adaptive=adaptive)
            drafter.close()
            rows.append(dict(system=f"ours-{backend}", mode=name, prompt=i, tps=e2e(r),
                             ratio=e2e(r) / e2e(base), accept=r.acceptance_rate,
                             tpv=r.tokens_per_verify, same=r.tokens == base.tokens))
        print(f"[ours-{backend}] prompt {i}: target-only {e2e(base):.2f} tok/s; "
              + ", ".join(f"{x['mode']} {x['ratio']:.2f}x" for x in rows[-len(modes):]), flush=True)
    del target, draft
    gc.collect()
    return rows, {"verify_cost": v, "c": c, "target_step_s": t_call[1], "draft_step_s": t_draft}


class _LlamaDraft:
    """A co-located draft model for llama-cpp-python's draft_model= hook (greedy)."""

    def __init__(self, llama, gamma):
        self.llm, self.gamma = llama, gamma

    def __call__(self, input_ids, **kw):
        self.llm.reset()
        out = []
        self.llm.eval(list(input_ids))
        for _ in range(self.gamma):
            t = int(np.argmax(self.llm.scores[self.llm.n_tokens - 1]))
            out.append(t)
            self.llm.eval([t])
        return np.array(out, dtype=np.intc)


def run_llamacpp_peer(prompts, args):
    from llama_cpp import Llama
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    kw = dict(n_ctx=2048, n_threads=args.threads, verbose=False, logits_all=False)
    tgt_path = str(model_path("qwen2.5-coder-1.5b"))
    draft_llm = Llama(str(model_path("qwen2.5-coder-0.5b")), n_ctx=2048, n_threads=args.threads,
                      verbose=False, logits_all=True)
    modes = [("target-only", None)] + [(f"γ={g}", _LlamaDraft(draft_llm, g)) for g in args.gammas] \
        + [("ngram γ=3", LlamaPromptLookupDecoding(num_pred_tokens=3))]
    rows = []
    for name, dm in modes:
        llm = Llama(tgt_path, draft_model=dm, **kw)
        for i, text in enumerate(prompts):
            t0 = time.perf_counter()
            out = llm.create_chat_completion([{"role": "user", "content": text}], max_tokens=args.max_new,
                                             temperature=0.0, top_k=1)
            dt = time.perf_counter() - t0
            n = out["usage"]["completion_tokens"]
            rows.append(dict(system="llama-cpp-python", mode=name, prompt=i, tps=n / dt, accept=None, tpv=None))
        del llm
        gc.collect()
    base = {r["prompt"]: r["tps"] for r in rows if r["mode"] == "target-only"}
    for r in rows:
        r["ratio"] = r["tps"] / base[r["prompt"]]
    print("[llama-cpp-python] done", flush=True)
    return rows


def run_hf_peer(prompts, args):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    def load(name):
        p = model_path(name)
        return AutoModelForCausalLM.from_pretrained(str(p.parent), gguf_file=p.name, dtype=torch.float32)

    torch.set_num_threads(args.threads)
    tok = AutoTokenizer.from_pretrained(str(model_path("qwen2.5-coder-1.5b").parent),
                                        gguf_file=model_path("qwen2.5-coder-1.5b").name)
    target, assistant = load("qwen2.5-coder-1.5b"), load("qwen2.5-coder-0.5b")
    rows = []
    for i, text in enumerate(prompts[: args.hf_prompts]):
        ids = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                      return_tensors="pt", return_dict=True)
        for name, extra in [("target-only", {}), ("assisted", {"assistant_model": assistant}),
                            ("prompt lookup 3", {"prompt_lookup_num_tokens": 3})]:
            t0 = time.perf_counter()
            out = target.generate(**ids, max_new_tokens=args.max_new, do_sample=False, **extra)
            dt = time.perf_counter() - t0
            n = out.shape[1] - ids["input_ids"].shape[1]
            rows.append(dict(system="hf-transformers", mode=name, prompt=i, tps=n / dt, accept=None, tpv=None))
    base = {r["prompt"]: r["tps"] for r in rows if r["mode"] == "target-only"}
    for r in rows:
        r["ratio"] = r["tps"] / base[r["prompt"]]
    print("[hf-transformers] done", flush=True)
    return rows


def summarise(rows):
    out = {}
    for r in rows:
        out.setdefault((r["system"], r["mode"]), []).append(r)
    table = []
    for (system, mode), rs in out.items():
        acc = [r["accept"] for r in rs if r.get("accept") is not None]
        tpv = [r["tpv"] for r in rs if r.get("tpv") is not None]
        table.append(dict(system=system, mode=mode, n=len(rs), tps=statistics.median(r["tps"] for r in rs),
                          ratio=statistics.median(r["ratio"] for r in rs),
                          accept=statistics.median(acc) if acc else None,
                          tpv=statistics.median(tpv) if tpv else None,
                          lossless=all(r.get("same", True) for r in rs)))
    return table


def write(table, costs, args, rows):
    out = args.out
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = dict(machine=platform.processor() or platform.machine(), cores=__import__("os").cpu_count(),
                prompts=args.prompts, max_new=args.max_new, threads=args.threads, date=time.strftime("%F %T"))
    out.with_suffix(".json").write_text(json.dumps(dict(meta=meta, table=table, costs=costs, rows=rows),
                                                   indent=1, default=str))
    lines = [f"# Local speculative decoding (Qwen2.5-Coder 0.5B → 1.5B, greedy, {args.prompts} MT-bench "
             f"prompts, {args.max_new} new tokens, {args.threads} threads, medians)\n",
             "| system | mode | tok/s (end to end) | vs own target-only | accept | tok/verify | greedy == target-only |",
             "|---|---|---|---|---|---|---|"]
    for t in table:
        f = lambda x: "-" if x is None else f"{x:.2f}"  # noqa: E731
        lines.append(f"| {t['system']} | {t['mode']} | {t['tps']:.2f} | {t['ratio']:.2f}x | {f(t['accept'])} | "
                     f"{f(t['tpv'])} | {'yes' if t['lossless'] else 'NO'} |")
    for backend, c in costs.items():
        lines.append(f"\n**{backend} cost model**: c = {c['c']:.2f}, verify cost v(k) = "
                     + ", ".join(f"{k}: {x:.2f}" for k, x in c["verify_cost"].items()))
        for t in table:
            if t["system"] == backend and t["mode"].startswith("γ=") and t["accept"] is not None:
                g = int(t["mode"][2:])
                vk = c["verify_cost"]
                pred = predicted_speedup(t["accept"], g, c["c"], lambda k: vk.get(k, vk[max(vk)] * k / max(vk)))
                lines.append(f"- {t['mode']}: predicted {pred:.2f}x, measured {t['ratio']:.2f}x")
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(10, 4.5))
    labels = [f"{t['system']}\n{t['mode']}" for t in table]
    colors = ["tab:green" if t["system"].startswith("ours") else "tab:gray" for t in table]
    ax.bar(range(len(table)), [t["ratio"] for t in table], color=colors)
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xticks(range(len(table)), labels, rotation=70, fontsize=7)
    ax.set_ylabel("speedup vs own target-only (median)")
    ax.set_title("Local speculative decoding on this machine (green: StarSun)")
    fig.tight_layout()
    fig.savefig(out.with_suffix(".png"), dpi=110)
    print(out.with_suffix(".md").read_text())


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=8, help="MT-bench first turns (the issue asks 80)")
    ap.add_argument("--max-new", type=int, default=64)
    ap.add_argument("--gammas", type=lambda s: [int(x) for x in s.split(",")], default=[1, 2, 4, 6])
    ap.add_argument("--backends", default="llamacpp,torch")
    ap.add_argument("--peers", default="llamacpp,hf")
    ap.add_argument("--hf-prompts", type=int, default=2, help="HF runs at ~1 tok/s: fewer prompts")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=result_stem("local_spec"), help="results path without suffix")
    args = ap.parse_args()
    prompts = mtbench_first_turns(args.prompts)
    rows, costs = [], {}
    for b in [b for b in args.backends.split(",") if b]:
        r, c = run_ours(b, prompts, args)
        rows += r
        costs[f"ours-{b}"] = c
    peers = [p for p in args.peers.split(",") if p]
    if "llamacpp" in peers:
        rows += run_llamacpp_peer(prompts, args)
    if "hf" in peers:
        rows += run_hf_peer(prompts, args)
    write(summarise(rows), costs, args, rows)


if __name__ == "__main__":
    main()
