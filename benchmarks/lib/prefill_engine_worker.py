"""The engine alone at each prefill setting, for benchmarks/engines/prefill_speed.py --sweep.

    python -m benchmarks.lib.prefill_engine_worker GGUF TOKENS ROUNDS    (the parent pins it)

LlamaCppEngine.forward_last over TOKENS prompt tokens (the call the endpoint's prefill makes), one
thread, every setting loaded at once and the rounds interleaved; prints one JSON line: per setting
the wall and thread-CPU tokens a second of each round.
"""
from __future__ import annotations

import json
import sys
import time

SETTINGS = {      # LlamaCppEngine's n_batch is also its n_ubatch: what one llama_decode computes at once
    "n_ubatch 512 (llama-server's, ours)": dict(n_batch=512),
    "n_ubatch 256": dict(n_batch=256),
    "n_ubatch 1024": dict(n_batch=1024),
    "n_ubatch 2048": dict(n_batch=2048),
    "n_ubatch 512, flash attention off": dict(n_batch=512, flash_attn=False),
    "n_ubatch 512, flash attention on": dict(n_batch=512, flash_attn=True),
}


def main() -> None:
    from benchmarks.lib.prefill_servers import prompt_ids
    from edge.engines.llamacpp_engine import LlamaCppEngine
    gguf, tokens, rounds = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    ids_for = prompt_ids(gguf)
    engines = {name: LlamaCppEngine(gguf, max_len=tokens + 256, n_seq_max=1, threads=1, **kw)
               for name, kw in SETTINGS.items()}
    out = {name: {"settings": kw, "tok_s": [], "cpu_tok_s": []} for name, kw in SETTINGS.items()}
    for r in range(rounds + 1):                 # round 0 warms each engine up
        names = list(engines) if r % 2 == 0 else list(reversed(engines))
        for name in names:
            eng = engines[name]
            ids = ids_for(tokens, r)
            seq = eng.new_sequence()
            w, c = time.perf_counter(), time.thread_time()
            eng.forward_last(seq, ids)
            w, c = time.perf_counter() - w, time.thread_time() - c
            eng.free(seq)
            if r:
                out[name]["tok_s"].append(round(tokens / w, 2))
                out[name]["cpu_tok_s"].append(round(tokens / c, 2))
            print(name, round(tokens / w, 1), round(tokens / c, 1), file=sys.stderr, flush=True)
    print(json.dumps({"tokens": tokens, "threads": 1, "settings": out}))


if __name__ == "__main__":
    main()
