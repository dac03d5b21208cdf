"""The hub's side measured alone, in its own process pinned to the hub's core (benchmarks/star/reverse_star.py):

* plain batched decoding -- what vLLM or llama-server does for N clients: N prompts prefilled, then
  one `forward_batch` of N single tokens a step (llama.cpp: one llama_decode), greedy; tokens/s over
  the decode, the clients generating the drafting devices' prompts in the same groups;
* the hub's call time by tokens in all: `forward_batch` over b sequences of k tokens each (the
  verify service's call for b sessions at γ = k-1), medians -- the reverse planner's table -- and
  one call over each prompt (the verify service's prefill of a generation's prompt), keyed by its length.

    python -m benchmarks.lib.reverse_baseline_worker --target PATH --prompts FILE --ns 1,2,4,8 --new 48 --ks 2,4,5,6
Prints one JSON object on stdout.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time


def plain_batched(engine, prompts: list, n: int, new: int) -> dict:
    """n clients decoded together by one batched call a step, each generating the prompts the n
    drafting devices generate (reverse_star_parts.jobs_of), job k of every client together; tokens/s
    over the decode (the prompts' prefills not timed, nor in the reverse star's rates)."""
    from benchmarks.lib.reverse_star_parts import jobs_of
    jobs = jobs_of(prompts, n)
    spent = [0.0] * n                                     # each client's decode seconds
    for k in range(max(map(len, jobs))):
        group = [i for i in range(n) if len(jobs[i]) > k]
        dt = decode_group(engine, [jobs[i][k] for i in group], new)
        for i in group:
            spent[i] += dt
    rates = [new * len(jobs[i]) / spent[i] for i in range(n)]
    return {"n": n, "tokens": new * sum(map(len, jobs)), "seconds": sum(spent) / n, "hub_tps": sum(rates),
            "per_client_tps": statistics.median(new / (spent[i] / len(jobs[i])) for i in range(n))}


def decode_group(engine, prompts: list, new: int) -> float:
    """Seconds to decode `new` tokens for each prompt at once (prefilled first, untimed)."""
    seqs = [engine.new_sequence() for _ in prompts]
    try:
        last = []
        for s, p in zip(seqs, prompts):
            engine.forward_last(s, p[:-1])
            last.append(p[-1])
        t0 = time.perf_counter()
        for _ in range(new):
            rows = engine.forward_batch([(s, [t], True) for s, t in zip(seqs, last)])
            last = [int(r[-1].argmax()) for r in rows]
        return time.perf_counter() - t0
    finally:
        for s in seqs:
            engine.free(s)


def call_table(engine, prompts: list, bs: list, ks: list, reps: int) -> dict:
    """Median ms of one forward_batch over b sequences x k tokens, keyed by b*k (the smallest seen)."""
    out: dict = {}
    seqs = [engine.new_sequence() for _ in range(max(bs))]
    try:
        base = []
        for i, s in enumerate(seqs):
            p = prompts[i % len(prompts)]
            t0 = time.perf_counter()
            engine.forward_last(s, p)
            if i < len(prompts):                          # a prompt's prefill: one call over its tokens
                out[len(p)] = 1e3 * (time.perf_counter() - t0)
            base.append(engine.length(s))
        for b in bs:
            for k in ks:
                times = []
                for _ in range(reps):
                    t0 = time.perf_counter()
                    engine.forward_batch([(s, [100 + j for j in range(k)]) for s in seqs[:b]])
                    times.append(1e3 * (time.perf_counter() - t0))
                    for s, n in zip(seqs[:b], base):
                        engine.truncate(s, n)
                key = b * k
                ms = statistics.median(times)
                out[key] = min(out.get(key, ms), ms)
    finally:
        for s in seqs:
            engine.free(s)
    return {str(k): v for k, v in sorted(out.items())}


def main(argv=None) -> None:
    from edge.engines.loader import open_model
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", required=True)
    ap.add_argument("--prompts", required=True, help="a JSON list of token-id lists")
    ap.add_argument("--ns", default="1,2,4,8")
    ap.add_argument("--new", type=int, default=48)
    ap.add_argument("--ks", default="1,2,4,5")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--max-len", type=int, default=1024)
    ap.add_argument("--backend", default="llamacpp", choices=("llamacpp", "torch"))
    ap.add_argument("--dtype", default="bfloat16", help="the torch engine's weights")
    a = ap.parse_args(argv)
    ns = [int(x) for x in a.ns.split(",")]
    prompts = json.loads(open(a.prompts).read())
    kw = dict(n_seq_max=max(ns) + 1) if a.backend == "llamacpp" else dict(dtype=a.dtype)
    engine, _ = open_model(a.target, backend=a.backend, threads=1, max_len=a.max_len, **kw)
    out = {"plain": [plain_batched(engine, prompts, n, a.new) for n in ns],
           "call_ms": call_table(engine, prompts, ns, [int(k) for k in a.ks.split(",")], a.reps)}
    json.dump(out, sys.stdout)


if __name__ == "__main__":
    main()
