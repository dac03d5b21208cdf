"""What benchmarks.gpu.gpu_check measures on one torch device: random-weight models of the real
shapes behind TorchEngine, timed as the roles use them.

Timings do not depend on weight values (no data-dependent kernels here), so the models are random:
the GPU machine reaches no registry and the real weights do not travel. Every engine call returns
its logits rows to the host as numpy, which synchronises the device: wall-clock around a call is
the call's full cost, host copy included (what a role pays).
"""
from __future__ import annotations

import statistics
import time
from typing import Callable, Dict, List, Sequence

import numpy as np
import torch

from edge.engines.torch_engine import TorchEngine
from edge.model.transformer import ModelConfig, Transformer, tiny_config

# the real models' shapes as the kit loads them (their GGUFs' metadata: the Qwen files carry their
# own output matrix; tests/unit/test_gpu_check.py compares them where the models are fetched)
SHAPES: Dict[str, ModelConfig] = {
    "smollm2-135m": ModelConfig(arch="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536,
                                num_layers=30, num_heads=9, num_kv_heads=3, rope_theta=100000.0,
                                max_position=8192, tie_embeddings=True),
    "qwen2.5-coder-0.5b": ModelConfig(arch="qwen2", vocab_size=151936, hidden_size=896, intermediate_size=4864,
                                      num_layers=24, num_heads=14, num_kv_heads=2, rope_theta=1000000.0,
                                      rms_norm_eps=1e-6, max_position=32768, tie_embeddings=False, qkv_bias=True),
    "qwen2.5-coder-1.5b": ModelConfig(arch="qwen2", vocab_size=151936, hidden_size=1536, intermediate_size=8960,
                                      num_layers=28, num_heads=12, num_kv_heads=2, rope_theta=1000000.0,
                                      rms_norm_eps=1e-6, max_position=32768, tie_embeddings=False, qkv_bias=True),
}
# --quick (the CPU dry run): the same code paths on small shapes
QUICK_SHAPES: Dict[str, ModelConfig] = {
    "tiny-llama": tiny_config("llama", vocab_size=512, num_layers=2, max_position=1024),
    "tiny-qwen2": tiny_config("qwen2", vocab_size=512, num_layers=3, max_position=1024),
}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def build_engine(cfg: ModelConfig, device: str, dtype: str, max_len: int, seed: int = 0) -> TorchEngine:
    """A random-weight model of cfg's shape, made on the device itself (a 1.5B model never
    crosses the host), behind the engine the roles use."""
    torch.manual_seed(seed)
    with torch.device(device):
        model = Transformer(cfg)
    return TorchEngine(model, max_len=max_len, device=device, dtype=DTYPES[dtype])   # RoPE stays float32


def median_s(call: Callable[[], object], reps: int, warmup: int = 1) -> float:
    times = []
    for i in range(warmup + reps):
        t = time.perf_counter()
        call()
        if i >= warmup:
            times.append(time.perf_counter() - t)
    return statistics.median(times)


def prompt(n: int, vocab: int, seed: int = 1) -> List[int]:
    return [int(x) for x in np.random.default_rng(seed).integers(3, vocab, n)]


def step_times(eng: TorchEngine, batches: Sequence[int], context: int, reps: int) -> Dict[int, float]:
    """ms of one batched decode step (engine.step) over b sequences of `context` tokens each."""
    seqs = [eng.new_sequence() for _ in range(max(batches))]
    for s in seqs:
        eng.forward_last(s, prompt(context, eng.vocab_size, s))
    out = {}
    for b in batches:
        toks = prompt(b, eng.vocab_size, b)
        out[b] = 1e3 * median_s(lambda: eng.step(seqs[:b], toks), reps)
    for s in seqs:
        eng.free(s)
    return out


def verify_times(eng: TorchEngine, ks: Sequence[int], context: int, reps: int) -> Dict[int, float]:
    """ms of one call over k tokens after `context` (a target's verify of k-1 drafts), KV cut back each time."""
    s = eng.new_sequence()
    eng.forward_last(s, prompt(context, eng.vocab_size))
    out = {}
    for k in ks:
        toks = prompt(k, eng.vocab_size, 100 + k)

        def call():
            eng.forward(s, toks)
            eng.truncate(s, context)
        out[k] = 1e3 * median_s(call, reps)
    eng.free(s)
    return out


def prefill_tok_s(eng: TorchEngine, n: int, reps: int) -> float:
    toks = prompt(n, eng.vocab_size, 7)

    def call():
        s = eng.new_sequence()
        eng.forward_last(s, toks)
        eng.free(s)
    return n / median_s(call, reps)


def draft_service_times(eng: TorchEngine, batches: Sequence[int], gamma: int, context: int,
                        reps: int) -> Dict[int, float]:
    """ms of one DraftService step serving b requests at once (each: one token in -- the target
    rejected the last draft -- and gamma drafts out): the D(b) the hub's draft service pays."""
    from edge.star.draft_service import DraftLimits, DraftService
    from edge.wire.protocol import DraftRequest
    svc = DraftService(eng, DraftLimits(max_sessions=max(batches) + 1, ahead=False, max_gamma=gamma))
    sids = [f"s{i}" for i in range(max(batches))]
    ctx, seq, replies = {}, {s: 1 for s in sids}, {}
    for i, s in enumerate(sids):
        svc.open(s)
        ctx[s] = prompt(context, eng.vocab_size, i)
        svc.submit(DraftRequest(s, 1, 0, ctx[s], gamma))
    replies.update(svc.step())                       # the prefills
    out = {}
    for b in batches:
        times = []
        for r in range(reps + 1):                    # the first round warms up
            for s in sids[:b]:
                first = replies[s].tokens[0] if replies[s].tokens else 0
                keep = len(ctx[s])
                ctx[s].append((first + 1) % eng.vocab_size)
                seq[s] += 1
                svc.submit(DraftRequest(s, seq[s], keep, [ctx[s][-1]], gamma))
            t = time.perf_counter()
            replies.update(svc.step())
            times.append(time.perf_counter() - t)
        out[b] = 1e3 * statistics.median(times[1:])
    for s in sids:
        svc.close(s)
    svc.step()
    return out


def greedy_lossless(device: str, dtype: str, prompts: int = 6, max_new: int = 40, gamma: int = 4) -> dict:
    """Speculative greedy == plain greedy on this device and dtype, with a tiny random target and a
    draft that is the target plus noise (so drafts are accepted and rejected both)."""
    from edge.speculative.generate import ModelDrafter, generate_plain, generate_speculative
    target, draft = _tiny_pair(device, dtype, vocab=256, noise=0.01)      # acceptance ~0.5
    same, accepted, drafted, diffs = 0, 0, 0, []
    for i in range(prompts):
        ids, rows = prompt(12, target.vocab_size, 50 + i), []
        plain = generate_plain(target, ids, max_new, on_logits=lambda t, row: rows.append(row)).tokens
        spec = generate_speculative(target, ModelDrafter(draft), ids, max_new, gamma)
        accepted, drafted = accepted + spec.n_accepted, drafted + spec.n_drafted
        if list(spec.tokens) == list(plain):
            same += 1
            continue
        j = next((j for j, (x, y) in enumerate(zip(spec.tokens, plain)) if x != y), None)
        # a near-tie at the dtype's resolution (the k-token call rounds differently), or a real bug
        gap = None if j is None else float(rows[j][plain[j]] - rows[j][spec.tokens[j]])
        scale = 1.0 if j is None else max(1.0, float(abs(rows[j][plain[j]])))
        near_tie = gap is not None and gap <= 2 * torch.finfo(DTYPES[dtype]).eps * scale
        diffs.append({"prompt": i, "at": j, "plain_logit_gap": gap, "near_tie": near_tie})
    verdict = ("identical" if same == prompts else "differs only at near-ties of this dtype's rounding"
               if all(d["near_tie"] for d in diffs) else "DIFFERS beyond rounding")
    return {"prompts": prompts, "identical": same, "max_new": max_new, "gamma": gamma,
            "acceptance": accepted / max(1, drafted), "differences": diffs, "passed": same == prompts,
            "verdict": verdict}


def _tiny_pair(device: str, dtype: str, vocab: int, noise: float):
    """A tiny random target and its draft (the target plus noise), on the device."""
    cfg = tiny_config("llama", vocab_size=vocab, num_layers=2, max_position=512)
    torch.manual_seed(0)
    with torch.device(device):
        model, noisy = Transformer(cfg), Transformer(cfg)
    with torch.no_grad():
        for p, q in zip(model.parameters(), noisy.parameters()):
            p.normal_(0, 0.2)
            q.copy_(p + noise * torch.randn_like(p))
    return (TorchEngine(model, max_len=512, device=device, dtype=DTYPES[dtype]),
            TorchEngine(noisy, max_len=512, device=device, dtype=DTYPES[dtype]))


def chi2_lossless(device: str, dtype: str, n: int, length: int = 3, vocab: int = 4, gamma: int = 3) -> dict:
    """Sampled speculative decoding (temperature 1) against the target's exact distribution over
    every `length`-token sequence, the target's rows computed on the device (harness.goodness_of_fit's
    Pearson chi-square and its critical value at alpha 1e-4; its negative control runs in
    tests/unit/test_lossless.py)."""
    import itertools

    from edge.speculative.generate import ModelDrafter, generate_speculative
    from edge.speculative.sampling import SamplingParams, to_probs
    from harness.goodness_of_fit import chi_square, critical_value
    target, draft = _tiny_pair(device, dtype, vocab, noise=0.05)
    params, start = SamplingParams(temperature=1.0), [3, 1, 0]

    def row(ctx):
        s = target.new_sequence()
        out = target.forward_last(s, ctx)[-1]
        target.free(s)
        return to_probs(out, params)
    want = {}
    for seq in itertools.product(range(vocab), repeat=length):
        p, ctx = 1.0, list(start)
        for t in seq:
            p *= float(row(ctx)[t])
            ctx.append(t)
        want[seq] = p
    total = sum(want.values())
    want = {k: v / total for k, v in want.items()}       # float32 rows: renormalise the product
    counts: Dict[tuple, int] = {}
    drafter = ModelDrafter(draft, params)
    for i in range(n):
        seeded = SamplingParams(temperature=1.0, seed=10_000 + i)
        r = generate_speculative(target, drafter, start, length, gamma, seeded)
        counts[tuple(r.tokens)] = counts.get(tuple(r.tokens), 0) + 1
    stat, df = chi_square(counts, want, n)
    crit = critical_value(df)
    return {"n": n, "length": length, "vocab": vocab, "gamma": gamma, "chi2": stat, "df": df, "critical": crit,
            "passed": stat < crit}
