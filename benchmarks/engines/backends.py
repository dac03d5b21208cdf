"""Backends x precisions on one machine: decode speed, batching, verify cost, size, memory.

For each model and each (backend, precision) -- torch fp32; onnxruntime fp32,
int4 (MatMulNBits on the QSUN grid, exact float math), int4 with int8
activations (accuracy_level 4), int8 (ORT dynamic quantisation); llama.cpp
F16 / Q8_0 / Q4_0 written by export/gguf.py, Q4_K_M from llama.cpp's own
quantiser and the original GGUF -- it
measures, in a fresh subprocess each (so peak memory is that config's own):

* decode tokens/s at batch 1 and total tokens/s at batch 1, 4, 16 (medians of
  timed `step` calls after a 32-token prefill);
* the cost of one verify call over k tokens, in units of a one-token call;
* artifact bytes, bytes read per token (weights minus a lookup-only
  embedding), and the bandwidth bound = measured memory bandwidth / those bytes;
* peak RSS.

  python -m benchmarks.engines.backends                              # SmolLM2-135M, ~15 min on 2 busy cores
  python -m benchmarks.engines.backends --models qwen2.5-coder-0.5b,qwen2.5-coder-1.5b --configs onnx:int4,llamacpp:q4_0

Run from the repository root. Writes benchmarks/results/backends/<variant>.{json,png,md} (--out;
default: the variant `default`); exported artifacts are kept
in --work (default artifacts/backends) and reused.
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from benchmarks.lib.backends_report import BATCHES, KS, write_results
from benchmarks.lib.results import ROOT, result_stem

CONFIGS = ["torch:fp32", "onnx:fp32", "onnx:int8", "onnx:int4", "onnx:int4-acc4", "llamacpp:f16",
           "llamacpp:q8_0", "llamacpp:q4_0", "llamacpp:q4_k_m", "llamacpp:orig"]


# --- artifacts --------------------------------------------------------------------------------------

def artifact(model: str, config: str, work: Path) -> Path | None:
    """The file a config runs (exported on first use); None for torch (it loads the checkpoint)."""
    from edge.model.fetch import model_path
    backend, prec = config.split(":")
    src = model_path(model)
    if backend == "torch":
        return None
    if backend == "llamacpp" and prec == "orig":
        return src
    d = work / model
    d.mkdir(parents=True, exist_ok=True)
    if backend == "llamacpp":
        out = d / f"{prec}.gguf"
        if not out.exists():
            from export.gguf import export_gguf
            export_gguf(src, out, ftype=prec.upper())
        return out
    out = d / f"{prec}.onnx"
    if out.exists():
        return out
    from edge.model.checkpoint import load_model
    from export.onnx import export_onnx
    m, ck = load_model(src)
    if prec == "int8":
        from onnxruntime.quantization import QuantType, quantize_dynamic
        fp = artifact(model, "onnx:fp32", work)
        quantize_dynamic(str(fp), str(out), weight_type=QuantType.QInt8, per_channel=False,
                         use_external_data_format=True)
        return out
    kw = {"fp32": {}, "int4": dict(int4=True, int4_lm_head=True),
          "int4-acc4": dict(int4=True, int4_lm_head=True, accuracy_level=4)}[prec]
    t0 = time.perf_counter()
    export_onnx(m, out, fingerprint=ck.fingerprint, **kw)
    print(f"  exported {out.name} in {time.perf_counter() - t0:.0f} s", flush=True)
    return out


def files_of(path: Path) -> list:
    if path.suffix != ".onnx":
        return [path]
    return [path] + sorted(p for p in path.parent.glob(path.name + "*") if p != path)


@functools.lru_cache(maxsize=None)
def _shape(model: str):
    """(embedding elements, all parameter elements, tied) of a model."""
    from edge.model.checkpoint import load_checkpoint
    from edge.model.fetch import model_path
    ck = load_checkpoint(model_path(model))
    c = ck.config
    return c.vocab_size * c.hidden_size, sum(t.numel() for t in ck.state_dict.values()), c.tie_embeddings


def bytes_per_token(model: str, config: str, path: Path | None) -> int:
    """Weight bytes one decode step reads: all weights except an embedding used only for lookups."""
    emb, n, tied = _shape(model)
    if path is None:  # torch fp32: tied embeddings are read once, by lm_head
        return 4 * (n - (0 if tied else emb))
    total = sum(p.stat().st_size for p in files_of(path))
    if path.suffix == ".onnx":
        return onnx_bytes_per_token(path)
    import gguf
    r = gguf.GGUFReader(str(path))
    names = {t.name: t for t in r.tensors}
    return total - (int(names["token_embd.weight"].n_bytes) if "output.weight" in names else 0)


def onnx_bytes_per_token(path: Path) -> int:
    """Initializer bytes of a graph, less those only looked up (Gather), e.g. the embedding table."""
    import onnx
    g = onnx.load(str(path), load_external_data=False).graph
    users: dict = {}
    for n in g.node:
        for i in n.input:
            users.setdefault(i, set()).add(n.op_type)
    total = 0
    for t in g.initializer:
        ext = {e.key: e.value for e in t.external_data}
        size = int(ext["length"]) if "length" in ext else len(t.raw_data)
        if users.get(t.name, set()) - {"Gather"}:
            total += size
    return total


def bandwidth_gbs(threads: int = 1, mb: int = 512, repeats: int = 15) -> float:
    """Read bandwidth (GB/s): `threads` numpy sums over slices of a buffer much larger than the
    caches, at once (numpy releases the GIL), best of n. The runtimes read weights with all
    their threads, so their bound is the all-thread figure (one thread reads ~30 GB/s here,
    two ~54)."""
    import threading
    a = np.ones(mb * 2**20 // 8)
    parts = np.array_split(a, max(1, threads))
    best = 0.0
    for _ in range(repeats):
        ths = [threading.Thread(target=p.sum) for p in parts]
        t = time.perf_counter()
        for th in ths:
            th.start()
        for th in ths:
            th.join()
        best = max(best, a.nbytes / (time.perf_counter() - t))
    return best / 1e9


# --- one config, in its own process -----------------------------------------------------------------

def status_mb(key: str) -> float:
    """VmRSS / VmHWM of this process in MB (VmHWM restarts at exec, unlike ru_maxrss)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) / 1024
    return 0.0


def load(model: str, config: str, path, threads: int):
    backend, prec = config.split(":")
    from edge.engines.loader import load_engine
    if backend == "torch":
        from edge.model.fetch import model_path
        return load_engine(model_path(model), backend="torch", threads=threads, max_len=512)
    if backend == "onnx":
        return load_engine(path, backend="onnx", device="cpu", threads=threads, max_len=512)
    return load_engine(path, backend="llamacpp", threads=threads, max_len=256, n_seq_max=max(BATCHES),
                       fingerprint="bench")


def measure(engine, steps: int, prompt_len: int = 32) -> dict:
    rng = np.random.default_rng(0)
    vocab = min(engine.vocab_size, 30000)
    out = {"batch": {}, "verify_s": {}}
    for B in BATCHES:
        seqs = [engine.new_sequence() for _ in range(B)]
        for s in seqs:
            engine.forward(s, rng.integers(100, vocab, prompt_len).tolist())
        toks = rng.integers(100, vocab, (steps + 2, B))
        times = []
        for j in range(steps + 2):
            t = time.perf_counter()
            engine.step(seqs, toks[j].tolist())
            times.append(time.perf_counter() - t)
        med = statistics.median(times[2:])  # two warm-up steps
        out["batch"][B] = {"step_s": med, "total_tok_s": B / med}
        for s in seqs:
            engine.free(s)
    s = engine.new_sequence()
    engine.forward(s, rng.integers(100, vocab, 64).tolist())
    base = engine.length(s)
    for k in KS:
        times = []
        for _ in range(5):
            t = time.perf_counter()
            engine.forward(s, rng.integers(100, vocab, k).tolist())
            times.append(time.perf_counter() - t)
            engine.truncate(s, base)
        out["verify_s"][k] = statistics.median(times)
    engine.free(s)
    return out


def worker(model: str, config: str, path: str | None, threads: int, steps: int) -> dict:
    base = status_mb("VmRSS")
    t0 = time.perf_counter()
    eng = load(model, config, Path(path) if path else None, threads)
    res = {"load_s": time.perf_counter() - t0, "base_rss_mb": base}
    res.update(measure(eng, steps))
    res["peak_rss_mb"] = status_mb("VmHWM")
    return res


def run_one(model: str, config: str, a) -> dict:
    """One measurement of one config, in a fresh subprocess."""
    path = artifact(model, config, Path(a.work))
    spec = {"model": model, "config": config, "path": str(path) if path else None,
            "threads": a.threads, "steps": a.steps}
    p = subprocess.run([sys.executable, "-m", "benchmarks.engines.backends", "--worker", json.dumps(spec)],
                       capture_output=True, text=True, timeout=1800, cwd=ROOT)
    line = next((ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if line is None:
        raise RuntimeError(((p.stderr or p.stdout).strip().splitlines() or ["no output"])[-1][:300])
    res = json.loads(line[7:])
    res["batch"] = {int(k): v for k, v in res["batch"].items()}
    res["verify_s"] = {int(k): v for k, v in res["verify_s"].items()}
    return res


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="smollm2-135m")
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--rounds", type=int, default=1, help="run every config this many times, interleaved; "
                    "report the median round (shared, noisy machines)")
    ap.add_argument("--work", default=str(ROOT / "artifacts" / "backends"))
    ap.add_argument("--out", default=str(result_stem("backends")), help="results path without suffix")
    ap.add_argument("--rebound", metavar="JSON", help="re-measure the bandwidth now and rewrite that "
                    "result's bound columns, markdown and plot (the timings are kept)")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        spec = json.loads(a.worker)
        print("RESULT " + json.dumps(worker(**spec)), flush=True)
        return
    from edge.model.fetch import model_path
    if a.rebound:
        return rebound(Path(a.rebound), a.threads)
    bw = bandwidth_gbs(a.threads)
    print(f"read bandwidth {bw:.1f} GB/s ({a.threads} threads)", flush=True)
    todo = []
    for model in a.models.split(","):
        if not model_path(model).exists():
            print(f"skip {model}: not fetched (make models)")
            continue
        for config in a.configs.split(","):
            todo.append((model, config))
    runs: dict = {k: [] for k in todo}
    errors: dict = {}
    for rnd in range(a.rounds):  # interleaved, so a burst of load hits every config alike
        for model, config in todo:
            if (model, config) in errors:
                continue
            try:
                runs[(model, config)].append(run_one(model, config, a))
                r = runs[(model, config)][-1]
                print(f"[{rnd + 1}/{a.rounds}] {model} {config}: b1 {r['batch'][1]['total_tok_s']:.1f} tok/s, "
                      f"b16 {r['batch'][16]['total_tok_s']:.1f}, peak {r['peak_rss_mb']:.0f} MB", flush=True)
            except Exception as e:  # one failing config must not lose the others
                errors[(model, config)] = f"{type(e).__name__}: {e}"
                print(f"{model} {config}: FAILED {errors[(model, config)]}", flush=True)
    rows = []
    for model, config in todo:
        backend, prec = config.split(":")
        row = {"model": model, "backend": backend, "precision": prec}
        if (model, config) in errors:
            row["error"] = errors[(model, config)]
        else:
            rs = sorted(runs[(model, config)], key=lambda r: r["batch"][1]["step_s"])
            row.update(rs[(len(rs) - 1) // 2])  # the median round by batch-1 step time (the faster of two)
            row["rounds"] = len(rs)
            path = artifact(model, config, Path(a.work))
            row["artifact_bytes"] = (sum(f.stat().st_size for f in files_of(path)) if path
                                     else bytes_per_token(model, config, None))
            row["bytes_per_token"] = bytes_per_token(model, config, path)
        rows.append(row)
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"machine": platform.node(), "cpus": os.cpu_count(), "threads": a.threads, "steps": a.steps,
            "rounds": a.rounds,
            "load_avg": os.getloadavg(), "read_bandwidth_gbs": bw, "time": time.strftime("%Y-%m-%d %H:%M")}
    md = write_results(rows, meta, out)
    print(md)


def rebound(path: Path, threads: int) -> None:
    """Bandwidth bound of an earlier run with the bandwidth measured now (all threads)."""
    res = json.loads(path.read_text())
    for row in res["rows"]:               # JSON made the batch / k keys strings
        for k, v in list(row.items()):
            if isinstance(v, dict) and v and all(str(x).isdigit() for x in v):
                row[k] = {int(x): y for x, y in v.items()}
    meta = res["meta"]
    old = meta["read_bandwidth_gbs"]
    meta["read_bandwidth_gbs"] = bandwidth_gbs(threads)
    meta["bandwidth_note"] = (f"Bandwidth re-measured {time.strftime('%Y-%m-%d %H:%M')} with {threads} threads "
                              f"({meta['read_bandwidth_gbs']:.1f} GB/s; the run measured {old:.1f} GB/s "
                              "with one thread); timings unchanged.")
    print(write_results(res["rows"], meta, path.with_suffix("")))


if __name__ == "__main__":
    main()
