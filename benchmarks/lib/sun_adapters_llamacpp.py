"""llama.cpp rows of benchmarks/sun/sun_adapters.py: GGUF LoRA adapters in one worker vs full copies.

* adapters: ONE LlamaCppAdapterBackend (edge/sun/adapter_llamacpp.py, the torch-free worker) over the
  base GGUF with every task's GGUF LoRA loaded; each call takes the B oldest rows of ANY tasks and
  `prefill_rows` groups them by task: one adapter switch (llama_set_adapters_lora) per group, then one
  llama_decode per ROW into its own sequence (the worker does not put rows of one group in one decode).
* full copies: as many llama.cpp workers as the adapter worker's weight memory holds (base + T adapter
  files, divided by the base file), each a whole model read into its own memory (no mmap, so copies do
  not share pages); a task without a resident copy evicts the least recently used one and loads its
  file. Stand-in for a task's merged GGUF: the base file itself. A merged GGUF of the same type has the
  same tensor names, shapes and types, so the same load and prefill cost; only the values differ, and
  they do not change the time. (The other stand-in, the base with a fixed adapter, would charge the
  full copies the LoRA matmuls a merged file does not run.) Each call: the B oldest rows of the oldest
  request's task, one llama_decode per row, as the adapter worker does.

Micro-benchmarks on one context (medians): a P-token prefill on the bare base, under one adapter kept
active, and switching between two adapters before every call (switch cost = the difference, the
graph rebuild at the next decode included); one llama_decode over a group's rows vs one per row (what
batching the rows of a group would save); loading a full copy.
"""
from __future__ import annotations

import statistics
import tempfile
import time
from collections import OrderedDict
from pathlib import Path

import numpy as np

RANK = 16


def make_adapters(base_gguf: Path, cfg, n: int, out: Path, ftype: str) -> list:
    """n random rank-16 adapters on all seven linears (PEFT's A, B ~ N(0, 0.02)) as GGUF LoRA files."""
    import torch

    from edge.model.lora.adapter import init_adapter
    from edge.model.lora.files import save_adapter
    from export.gguf_lora import export_adapter
    paths = []
    for t in range(n):
        path = out / f"t{t}.{ftype}.gguf"
        if not path.is_file():
            ad = init_adapter(cfg, RANK, seed=t)
            g = torch.Generator().manual_seed(1000 + t)
            for k in sorted(ad.lora_b):
                ad.lora_b[k].copy_(torch.randn(ad.lora_b[k].shape, generator=g) * 0.02)
            save_adapter(out / f"t{t}", ad)
            export_adapter(out / f"t{t}", base_gguf, path, ftype=ftype, log=lambda m: None)
        paths.append(path)
    return paths


def _engine(base, batch: int, threads: int):
    from edge.engines.llamacpp_engine import LlamaCppEngine
    return LlamaCppEngine(base, max_len=128, n_seq_max=batch, threads=threads, mmap=False)


def run_adapters(worker, trace, prompts, batch: int) -> dict:
    ttft, t0, s0, c0 = [0.0] * len(trace), time.perf_counter(), worker.adapters.switches, time.process_time()
    for i in range(0, len(trace), batch):
        rows = list(range(i, min(i + batch, len(trace))))
        for _, export in worker.prefill_rows([prompts[r] for r in rows], [f"t{trace[r]}" for r in rows]):
            export.free()               # the KV hand-over is the same in both modes: not timed
        now = time.perf_counter() - t0
        for r in rows:
            ttft[r] = now
    return {"wall_s": time.perf_counter() - t0, "cpu_s": time.process_time() - c0, "ttft_s": ttft,
            "calls": -(-len(trace) // batch), "switches": worker.adapters.switches - s0, "loads": 0}


def run_full_copies(base, k: int, trace, prompts, batch: int, threads: int) -> dict:
    resident: "OrderedDict[int, object]" = OrderedDict()     # task -> its engine, least recently used first
    waiting = list(range(len(trace)))
    ttft, t0, calls, loads, c0 = [0.0] * len(trace), time.perf_counter(), 0, 0, time.process_time()
    try:
        while waiting:
            task = trace[waiting[0]]
            if task not in resident:
                if len(resident) >= k:
                    resident.popitem(last=False)[1].close()
                resident[task] = _engine(base, batch, threads)  # this task's merged GGUF (stand-in: the base)
                loads += 1
            resident.move_to_end(task)
            e = resident[task]
            rows = [r for r in waiting if trace[r] == task][:batch]
            for r in rows:
                s = e.new_sequence()
                e.forward_last(s, prompts[r])
                e.free(s)
            calls += 1
            now = time.perf_counter() - t0
            for r in rows:
                ttft[r] = now
            done = set(rows)
            waiting = [r for r in waiting if r not in done]
    finally:
        for e in resident.values():
            e.close()
    return {"wall_s": time.perf_counter() - t0, "cpu_s": time.process_time() - c0, "ttft_s": ttft, "calls": calls,
            "loads": loads}


def _timed(fn) -> tuple:
    """(wall ms, CPU ms of this process) of one call: CPU time is what contention on the shared
    cores inflates least (one pinned thread), wall time is what a request waits."""
    w, c = time.perf_counter(), time.process_time()
    fn()
    return (time.perf_counter() - w) * 1e3, (time.process_time() - c) * 1e3


def _rounds(cases: dict, reps: int) -> dict:
    """cases: name -> (setup, timed); every round runs each case once, setup untimed, so a change in
    the box's load hits all cases alike. -> name -> {"wall_ms", "cpu_ms"} medians."""
    got = {k: [] for k in cases}
    for _ in range(reps + 1):
        for name, (setup, fn) in cases.items():
            setup()
            got[name].append(_timed(fn))
    return {k: {"wall_ms": statistics.median(w for w, _ in v[1:]), "cpu_ms": statistics.median(c for _, c in v[1:])}
            for k, v in got.items()}                  # the first round warms up


def micro(base, adapters: list, prompt: list, group: int, threads: int, reps: int = 21) -> dict:
    """Per-call costs on one context: bare base, one adapter kept active, a switch before the call;
    a group of `group` rows as one llama_decode vs one per row; loading a full copy."""
    from edge.sun.adapter_llamacpp import LlamaCppAdapterBackend
    w = LlamaCppAdapterBackend(_engine(base, max(group, 2), threads))
    e, ad = w.engine, w.adapters
    try:
        for i, p in enumerate(adapters[:2]):
            w.add(f"m{i}", p)

        def prefill(name=None):
            if name is not None:
                ad.use(name)
            s = e.new_sequence()
            e.forward_last(s, prompt)
            e.free(s)

        def under(name):                         # set, and one untimed decode: its graph is built
            return lambda: (ad.use(name), prefill())

        def rows_in_one_decode():                # llama.cpp's batch: the rows' tokens, each on its own seq id
            seqs = [e.new_sequence() for _ in range(group)]
            entries = [(t, pos, e._get(s)) for s in seqs for pos, t in enumerate(prompt)]
            e._decode(entries, [(i + 1) * len(prompt) - 1 for i in range(group)])
            for s in seqs:
                e.free(s)
        one = _rounds({"base": (under(None), prefill), "kept": (under("m0"), prefill),
                       "switched": (under("m1"), lambda: prefill("m0")),
                       "set_call": (under("m1"), lambda: ad.use("m0"))}, reps)
        rows = _rounds({"per_row": (under("m0"), lambda: [prefill() for _ in range(group)]),
                        "one_decode": (under("m0"), rows_in_one_decode)}, max(3, reps // 4))
    finally:
        ad.close()
        e.close()
    load = _rounds({"load": (lambda: None, lambda: _engine(base, 16, threads).close())}, 5)["load"]
    return {"prompt_len": len(prompt), "group_rows": group, "reps": reps,
            "prefill_base": one["base"], "prefill_adapter_kept": one["kept"],
            "prefill_adapter_switched": one["switched"], "set_adapters_call": one["set_call"],
            "switch_ms": {k: one["switched"][k] - one["kept"][k] for k in ("wall_ms", "cpu_ms")},
            "lora_compute_ms": {k: one["kept"][k] - one["base"][k] for k in ("wall_ms", "cpu_ms")},
            "group_one_decode_per_row": rows["per_row"], "group_one_decode": rows["one_decode"],
            "full_copy_load": load}


def _summary(runs: list, tokens: int) -> dict:
    """Medians over repetitions of each mode's figures."""
    out = {k: v for k, v in runs[0].items() if k not in ("wall_s", "cpu_s", "ttft_s")}
    per = []
    for r in runs:
        t = np.array(r["ttft_s"]) * 1e3
        per.append({"wall_s": r["wall_s"], "cpu_s": r["cpu_s"], "tok_s": tokens / r["wall_s"],
                    "tok_per_cpu_s": tokens / r["cpu_s"], "ttft_p50_ms": float(np.percentile(t, 50)),
                    "ttft_p99_ms": float(np.percentile(t, 99))})
    for key in per[0]:
        out[key] = statistics.median(p[key] for p in per)
    out["tok_s_each"] = [round(p["tok_s"], 1) for p in per]
    return out


def bench(base: Path, cfg, n_tasks: int, trace: list, prompts: list, batch: int, threads: int, reps: int,
          adapter_type: str, work: Path) -> dict:
    from edge.sun.adapter_llamacpp import LlamaCppAdapterBackend
    paths = make_adapters(base, cfg, n_tasks, work, adapter_type)
    model_bytes, one = base.stat().st_size, paths[0].stat().st_size
    budget = model_bytes + n_tasks * one
    k = max(1, budget // model_bytes)
    worker = LlamaCppAdapterBackend(_engine(base, batch, threads))
    for t, p in enumerate(paths):
        worker.add(f"t{t}", p)
    ada, full = [], []
    try:
        for _ in range(reps):                     # interleaved: both modes see the same load on the box
            ada.append(run_adapters(worker, trace, prompts, batch))
            full.append(run_full_copies(base, k, trace, prompts, batch, threads))
    finally:
        worker.adapters.close()
        worker.engine.close()
    tokens = sum(map(len, prompts))
    a, f = _summary(ada, tokens), _summary(full, tokens)
    return {"tasks": n_tasks, "requests": len(trace), "prompt_len": len(prompts[0]), "batch": batch, "rank": RANK,
            "adapter_type": adapter_type, "adapter_bytes": one, "model_bytes": model_bytes, "budget_bytes": budget,
            "full_copies_fit": int(k), "distinct_tasks_in_trace": len(set(trace)), "reps": reps,
            "adapters": a, "full_copies": f, "tok_s_ratio": a["tok_s"] / f["tok_s"],
            "ttft_p99_ratio": f["ttft_p99_ms"] / a["ttft_p99_ms"],
            "tok_per_cpu_s_ratio": a["tok_per_cpu_s"] / f["tok_per_cpu_s"]}


def run_all(base: Path, cfg, task_counts: list, n_requests: int, prompt_len: int, batch: int, threads: int,
            reps: int, seed: int, adapter_type: str, zipf_trace, work: Path = None) -> dict:
    """cfg: the base's ModelConfig (shapes of the adapters); zipf_trace(n_tasks, n_requests, seed)."""
    rng = np.random.default_rng(seed)
    prompts = [[int(x) for x in rng.integers(1, cfg.vocab_size, prompt_len)] for _ in range(n_requests)]
    with tempfile.TemporaryDirectory(prefix="sun_adapters_") as tmp:
        work = Path(work or tmp)
        runs = []
        for n in task_counts:
            runs.append(bench(base, cfg, n, zipf_trace(n, n_requests, seed), prompts, batch, threads, reps,
                              adapter_type, work))
            r = runs[-1]
            print(f"llama.cpp {n} tasks: adapters {r['adapters']['tok_s']:.0f} tok/s, full copies "
                  f"{r['full_copies']['tok_s']:.0f} tok/s ({r['full_copies_fit']} fit, "
                  f"{r['full_copies']['loads']} loads)", flush=True)
        m = micro(base, make_adapters(base, cfg, 2, work, adapter_type), prompts[0], batch, threads)
    print(f"micro: {m}", flush=True)
    return {"runs": runs, "micro": m}
