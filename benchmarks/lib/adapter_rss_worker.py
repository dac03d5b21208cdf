"""A llama.cpp prefill worker's memory with N GGUF LoRA adapters loaded (a child of
benchmarks/device/adapter_memory.py, whose parent reads this process's peak RSS with os.wait4).

    python -m benchmarks.lib.adapter_rss_worker BASE.gguf ADAPTER.gguf [ADAPTER.gguf ...]

Opens the base as the prefill role loads it (1024 tokens x 8 sequences), loads every adapter
(each its own file: llama.cpp holds each one's tensors), prefills one prompt under the first
eight adapters (switching, as a worker does) and prints `RESULT {json}`. No torch is imported.
"""
from __future__ import annotations

import json
import resource
import sys

from edge.engines.llamacpp_engine import LlamaCppEngine
from edge.engines.llamacpp_lora import LlamaCppAdapters


def main(base: str, adapters: list) -> dict:
    eng = LlamaCppEngine(base, max_len=1024, n_seq_max=8)
    lora = LlamaCppAdapters(eng)
    for i, path in enumerate(adapters):
        lora.load(f"task{i}", path)
    tokens = list(range(1, 65))
    for i in range(min(8, len(adapters))):
        seq = eng.new_sequence()
        lora.prefill(seq, tokens, f"task{i}")
        eng.free(seq)
    return {"adapters": len(adapters), "switches": lora.switches,
            "self_maxrss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}


if __name__ == "__main__":
    print("RESULT " + json.dumps(main(sys.argv[1], sys.argv[2:])), flush=True)
