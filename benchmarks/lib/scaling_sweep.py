"""The StarSD scaling sweep's parts: one real draft service, N emulated targets per point.

benchmarks/star/starsd_scaling.py runs the sweep; benchmarks/star/draft_switch.py and
benchmarks/star/draft_formats.py reuse its pieces. `args_of` is the sweep's options; the real
draft (`load_draft`, `set_threads`), its prompts and measured acceptance (`mtbench_prompts`,
`measure_alpha`, `forced_hits`), the draft service's time per batch size (`measure_service`);
one point of the sweep in a worker process (`base_spec`, `stretch`, `run_point`, `summarize`).
"""
from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

import numpy as np

from benchmarks.lib.results import result_stem
from benchmarks.lib.starsd_worker import TargetProcess
from harness.emulated_target import DeviceTiming
from edge.model.fetch import model_path
from export.target_format import FORMATS, NATIVE, target_gguf

DATA_ALPHA = 0.68          # docs/models.md: 0.5B vs 1.5B greedy agreement on MT-bench, 0.64-0.72
DRAFT, TARGET = "qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b"


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def ints(s: str) -> list:
    return [int(x) for x in s.split(",") if x.strip()]


def args_of(argv=None, description: str = "StarSD scaling: one draft service, N targets"):
    """benchmarks/star/starsd_scaling.py's options (draft_switch.py parses its own sweep with them)."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--quick", action="store_true", help="short windows, alpha from docs/models.md, no real targets")
    ap.add_argument("--ns", type=ints, default=[1, 2, 4, 8, 16, 32])
    ap.add_argument("--gamma", type=int, default=4)
    ap.add_argument("--seconds", type=float, help="measurement window per point (default 45, quick 12)")
    ap.add_argument("--warmup", type=float, help="seconds after every target got its first draft (8, quick 4)")
    ap.add_argument("--profile", default="jetson-orin-nano-8gb", help="device profile of the emulated targets")
    ap.add_argument("--net-rtt-ms", type=float, default=2.0, help="emulated device<->hub round trip")
    ap.add_argument("--time-scale", type=float, default=1.0, help="multiply every emulated device time")
    ap.add_argument("--verify-cost", default="", help="override the profile's verify cost: '2=1.05,5=1.2'")
    ap.add_argument("--target-step-ms", type=float,
                    help="the emulated target's step instead of the profile's roofline (e.g. a target "
                         "measured on this machine; give its --verify-cost too)")
    ap.add_argument("--target-label", default="", help="what the emulated targets stand for, for the report")
    ap.add_argument("--alpha", default=None, help="a number, 'measure' (real 1.5B greedy) or 'data' (docs/models.md)")
    ap.add_argument("--alpha-prompts", type=int, default=4)
    ap.add_argument("--alpha-tokens", type=int, default=32)
    ap.add_argument("--draft-backend", choices=["llamacpp", "torch"], default="llamacpp")
    ap.add_argument("--draft-threads", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--draft-format", default="native", choices=FORMATS,
                    help="the draft's GGUF storage format (llamacpp): Q4_0 batches best on x86 "
                         "(benchmarks/star/draft_formats.py)")
    ap.add_argument("--broker-kind", dest="broker", choices=["mosquitto", "embedded"], default="mosquitto", help="for the sweep")
    ap.add_argument("--overhead-brokers", default="mosquitto,embedded")
    ap.add_argument("--real-targets", type=ints, default=None, help="N for real 1.5B targets (default 2, quick none)")
    ap.add_argument("--deadline", choices=["wait", "adaptive"], default="wait",
                    help="wait: targets always wait for the draft (the planner's closed loop); "
                         "adaptive: the real deadline (late drafts -> decode alone)")
    ap.add_argument("--ahead", action="store_true", help="let the draft service draft ahead when idle")
    ap.add_argument("--coalesce", action="store_true",
                    help="let the draft service hold a batch for sessions due back (edge/star/batch_hold.py)")
    ap.add_argument("--join", action=argparse.BooleanOptionalAction, default=True,
                    help="iteration-level batching (the CLI's default): requests join the draft's batch "
                         "at its next step; --no-join: whole batches")
    ap.add_argument("--prompt-tokens", type=int, default=128, help="longest prompt (chat template included)")
    ap.add_argument("--reps", type=int, help="repeats per batch size of the draft service micro-benchmark")
    ap.add_argument("--pin", action="store_true", help="cores as devices: the hub + draft service (this "
                    "process, 1 draft thread) on core 1, every emulated target on core 0")
    ap.add_argument("--out", default=str(result_stem("starsd_scaling")), help="results path without suffix")
    a = ap.parse_args(argv)
    q = a.quick
    a.seconds = a.seconds or (12.0 if q else 45.0)
    a.warmup = a.warmup if a.warmup is not None else (4.0 if q else 8.0)
    a.alpha = a.alpha or ("data" if q else "measure")
    a.real_targets = a.real_targets if a.real_targets is not None else ([] if q else [2])
    a.reps = a.reps or (2 if q else 5)
    a.verify = {int(k): float(v) for k, v in (kv.split("=") for kv in a.verify_cost.split(",") if kv)}
    if a.pin:
        a.draft_threads = 1
    return a


# ---- the real draft ----
def load_draft(backend: str, threads: int, slots: int, max_len: int, fmt: str = NATIVE):
    from edge.model.tokenizer import Tokenizer
    tok = Tokenizer.from_gguf(model_path(DRAFT))
    if backend == "llamacpp":
        from edge.engines.llamacpp_engine import LlamaCppEngine
        eng = LlamaCppEngine(target_gguf(DRAFT, fmt), max_len=max_len, n_seq_max=slots, threads=threads)
    else:
        import torch
        from edge.model.checkpoint import load_model
        from edge.engines.torch_engine import TorchEngine
        model, ck = load_model(model_path(DRAFT), dtype=torch.float32)
        eng = TorchEngine(model, ck.fingerprint, max_len=max_len, threads=threads)
    return eng, tok


def set_threads(engine, n: int) -> None:
    """Threads of the draft engine. llama.cpp's threads spin at every barrier: with more threads
    than free cores (real targets on the same machine) each call collapses."""
    lc, ctx = getattr(engine, "_lc", None), getattr(engine, "_ctx", None)
    if lc is not None and ctx:
        lc.llama_set_n_threads(ctx, n, n)
    elif engine.name == "torch":
        import torch
        torch.set_num_threads(n)


def mtbench_prompts(tok, max_tokens: int) -> list:
    from benchmarks.lib.datasets import mtbench_first_turns
    out = []
    for text in mtbench_first_turns(80):
        ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": text}]))
        if len(ids) <= max_tokens:
            out.append(ids)
    if not out:
        raise SystemExit(f"no MT-bench prompt fits in --prompt-tokens {max_tokens}")
    return out


def forced_hits(draft, prompt: list, continuation: list) -> int:
    """Positions of `continuation` (the target's own greedy text after `prompt`) where the draft's
    argmax, teacher-forced on it, is the target's token."""
    seq = draft.new_sequence()
    pred = draft.forward(seq, prompt + continuation[:-1])[len(prompt) - 1:].argmax(axis=-1)
    draft.free(seq)
    return int((pred == np.asarray(continuation)).sum())


def measure_alpha(draft, tok, prompts, n_prompts: int, n_tokens: int, threads: int) -> dict:
    """Position-by-position greedy agreement of the draft with the real 1.5B target's own greedy text."""
    from edge.engines.llamacpp_engine import LlamaCppEngine
    from edge.speculative.generate import generate_plain
    target = LlamaCppEngine(model_path(TARGET), max_len=1024, n_seq_max=1, threads=threads)
    hits = total = 0
    t0 = time.perf_counter()
    for p in prompts[:n_prompts]:
        out = generate_plain(target, p, n_tokens, stop_ids=tuple(tok.eos_ids)).tokens
        if not out:
            continue
        hits += forced_hits(draft, p, out)
        total += len(out)
    target.close()
    return {"alpha": hits / max(1, total), "positions": total, "prompts": n_prompts, "seconds": time.perf_counter() - t0,
            "source": f"measured: {TARGET} greedy, {DRAFT} argmax agreement"}


def measure_service(engine, bs, gamma: int, prompts, reps: int) -> dict:
    """D(b): seconds of one DraftService batch serving b requests (each: one token in, gamma drafts out)."""
    from edge.wire.protocol import DraftRequest
    from edge.star.draft_service import DraftLimits, DraftService
    svc = DraftService(engine, DraftLimits(max_sessions=max(bs) + 1, ahead=False, max_gamma=gamma))
    replies: dict = {}

    def step():
        replies.update(svc.step())
    sids = [f"b{i}" for i in range(max(bs))]
    ctx, seq = {}, {s: 1 for s in sids}
    for i, s in enumerate(sids):
        svc.open(s)
        ctx[s] = list(prompts[i % len(prompts)])
        svc.submit(DraftRequest(s, 1, 0, ctx[s], gamma))
    step()                                           # prefills
    out = {}
    for b in bs:
        times = []
        for r in range(reps + 1):                    # the first round warms up
            for s in sids[:b]:
                first = replies[s].tokens[0] if replies[s].tokens else 0
                keep = len(ctx[s])
                ctx[s].append((first + 1) % engine.vocab_size)   # the target rejected the first draft
                seq[s] += 1
                svc.submit(DraftRequest(s, seq[s], keep, [ctx[s][-1]], gamma))
            t = time.perf_counter()
            step()
            times.append(time.perf_counter() - t)
        out[b] = statistics.median(times[1:])
        log(f"draft service: batch {b}: {1e3 * out[b]:.0f} ms for {gamma} drafts each")
    for s in sids:
        svc.close(s)
    svc.step()                                       # frees the sequences
    return out


# ---- one point ----
def run_point(spec: dict, hub=None, workdir: Path = Path(".")) -> dict:
    snap: dict = {}
    svc = hub.service if hub is not None else None

    def start():
        if svc is not None:
            svc.stats.reset()

    def stop():
        if svc is not None:
            snap.update(svc.stats.snapshot())
    res = TargetProcess(spec, workdir).run(start, stop, log)
    if svc is not None:                               # the next point starts with a quiet draft
        end = time.monotonic() + 90
        while time.monotonic() < end and (svc.sessions() or svc.pending()):
            time.sleep(0.1)
    return summarize(res, snap, spec)


def summarize(res: dict, draft: dict, spec: dict) -> dict:
    w = res["window_s"]
    ts = res["targets"]
    tps = [t["tokens"] / w for t in ts]
    tpot = np.array([x for t in ts for x in t["tpot_s"]]) * 1e3
    net = DeviceTiming.from_dict(spec["timing"]).net_rtt_ms if spec.get("timing") and not spec.get("real") else 0.0
    ans = [a for t in ts for a in t.get("answers", []) if a[2] <= 4]
    over = np.array([1e3 * (rtt - comp) - net for rtt, comp, _ in ans])
    drafted, accepted = sum(t["drafted"] for t in ts), sum(t["accepted"] for t in ts)
    out = {"n": res["n"], "mode": res["mode"], "window_s": w, "system_tps": sum(tps), "per_target_tps": tps,
           "per_target_tps_mean": float(np.mean(tps)), "tokens": sum(t["tokens"] for t in ts),
           "acceptance": accepted / drafted if drafted else None,
           "tokens_per_round": sum(t["tokens"] for t in ts) / max(1, sum(t["rounds"] for t in ts)),
           "plain_rounds": sum(t["plain_rounds"] for t in ts), "rounds": sum(t["rounds"] for t in ts),
           "errors": [t["error"] for t in ts if t["error"]],
           "targets_cpu": res.get("worker_cpu_s", 0.0) / w}      # share of core 0 the targets' process used
    if tpot.size:
        out.update(tpot_p50_ms=float(np.percentile(tpot, 50)), tpot_p99_ms=float(np.percentile(tpot, 99)),
                   tpot_mean_ms=float(tpot.mean()), tpot_var_ms2=float(tpot.var()))
    if over.size:
        out.update(overhead_median_ms=float(np.median(over)), overhead_p90_ms=float(np.percentile(over, 90)),
                   overhead_samples=int(over.size))
    if draft:
        req = max(1, draft["requests"])
        out["draft"] = {k: draft[k] for k in ("requests", "busy_s", "idle_s", "ahead_s", "busy_ratio",
                                              "batch_size_mean", "batch_size_max", "s_of_d", "step_of_b",
                                              "t_idle_mean_s")}
        out["busy_ratio"] = draft["busy_ratio"]
        out["mean_batch"] = draft["batch_size_mean"]
        out["s_d_ms"] = 1e3 * draft["busy_s"] / req
        out["t_idle_ms"] = 1e3 * draft["idle_s"] * res["n"] / req      # T_γ = N·S(d) + T_idle
        out["iteration_ms"] = 1e3 * w * res["n"] / req
        out["draft_batches"] = sum(v["batches"] for v in draft["s_of_d"].values())
    return out


def base_spec(a, mode: str, n: int, prompts, timing, alpha, vocab, fp, url=None, real=None) -> dict:
    return {"mode": mode, "n": n, "gamma": a.gamma, "url": url, "tokenizer_fp": fp, "vocab_size": vocab,
            "prompts": prompts, "timing": timing.to_dict(), "alpha": alpha, "seed": n,
            "warmup_s": a.warmup, "seconds": a.seconds, "max_len": 1400, "deadline": a.deadline,
            "real": real, "stop_ids": [], "ready_timeout_s": 900, "cpus": [0] if a.pin else None}


def stretch(spec: dict, d_ms: float, r_ms: float, a) -> dict:
    """Windows long enough for a few draft iterations even when the draft is slow."""
    it = (d_ms + r_ms) / 1e3
    spec["seconds"] = min(max(a.seconds, 4 * it), 5 * a.seconds)
    spec["warmup_s"] = min(max(a.warmup, 1.5 * it), 5 * a.warmup)
    return spec
