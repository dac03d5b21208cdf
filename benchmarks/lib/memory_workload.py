"""One memory case in a fresh process: open a role's engine the way `edge-agent run` does and drive
it through the role's largest calls, so its peak RSS can be read by the parent (os.wait4).

    python -m benchmarks.lib.memory_workload '{"backend": "llamacpp", "model": "qwen2.5-coder-1.5b",
                                            "role": "target", "context": 4096, "sequences": 1}'

Workloads (the calls each role makes, at the context the plan is for):
  target   one sequence: prefill `fill` tokens (forward_last), then verify calls over gamma+1 tokens
  draft    `sequences` sessions, each prefilled to `fill`, then batched steps over all of them
  decoder  `sequences` rows, each prefilled to `fill`, then batched steps (the shared decoder's loop)
  prefill  one prompt of `fill` tokens (forward_last), then its KV exported as a float16 blob
  llama    llama-cpp-python's own Llama(path, n_ctx=context) generating a few tokens: the runtime's
           footprint the agent's is compared with
Prints one JSON line with what the process itself saw (torch imported or not, the plan it used).
"""
from __future__ import annotations

import json
import sys


def _ids(n: int, vocab: int, seed: int = 0) -> list:
    # ordinary token ids well inside every vocabulary; content does not change memory
    return [100 + (seed * 7919 + i * 31) % min(vocab - 200, 20000) for i in range(n)]


def run_case(case: dict) -> dict:
    role, ctx, S = case["role"], int(case["context"]), int(case.get("sequences", 1))
    gamma = int(case.get("gamma", 4))
    if role == "llama":
        return _llama_own(case)
    from edge.engines.loader import open_model
    from edge.memory.fit import engine_kwargs
    kw = engine_kwargs(case["backend"], role, S)
    if "repack" in case:                  # llama.cpp's CPU weight repacking, as --repack gives it
        from edge.engines.llamacpp_repack import repack_kwargs
        kw.update(repack_kwargs(case["repack"]))
    engine, _tok = open_model(case["model"], backend=case["backend"], role=role,
                              dtype=case.get("dtype", "float32"), max_len=ctx, **kw)
    fill = int(case.get("fill") or ctx - gamma - 4)
    V = engine.vocab_size
    if role == "target":
        s = engine.new_sequence()
        engine.forward_last(s, _ids(fill, V))
        for _ in range(2):
            engine.forward(s, _ids(gamma + 1, V, 1))
            engine.truncate(s, fill)
    elif role in ("draft", "decoder"):
        seqs = []
        for i in range(S):
            seqs.append(engine.new_sequence())
            engine.forward_last(seqs[-1], _ids(fill, V, i))
        for _ in range(2):
            engine.step(seqs, [7] * S)
        if role == "draft":
            engine.forward(seqs[0], _ids(gamma, V, 2))
    elif role == "prefill":
        s = engine.new_sequence()
        engine.forward_last(s, _ids(fill, V))
        blob = engine.export_kv(s, "float16")
        del blob
    else:
        raise SystemExit(f"unknown role {role!r}")
    return {"torch_imported": "torch" in sys.modules, "engine_kwargs": kw, "fill": fill}


def _llama_own(case: dict) -> dict:
    from llama_cpp import Llama

    from edge.model.reference import resolve_model
    llm = Llama(str(resolve_model(case["model"])), n_ctx=int(case["context"]), verbose=False)
    llm(" ".join(["def"] * 64), max_tokens=8)
    return {"torch_imported": "torch" in sys.modules}


if __name__ == "__main__":
    out = run_case(json.loads(sys.argv[1]))
    print("RESULT " + json.dumps(out), flush=True)
