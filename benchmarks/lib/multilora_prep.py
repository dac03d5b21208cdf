"""What benchmarks/sun/sun_vs_multilora.py serves, made once under runs/sun_vs_multilora/ (resumable):

* tuned/sun-s{seed}: prefill-only LoRA adapters (`edge-export tune --adapter lora`, `tune_command`) on
  the tools task (BFCL); tuned/ordinary-s0: the same tuning with the adapter on every token
  (benchmarks/lib/ordinary_lora.py) -- llama-server's fair row. What the record used, on 2 cores
  at load ~20 (a step took 2-5 min):
      edge-export tune --base qwen2.5-coder-0.5b --task tools --adapter lora --rank 8 --steps 12 \
          --batch-size 2 --max-len 320 --ckpt-every 3 --n-eval 8 --eval-every 1000 --threads 2 --seed 0 \
          --out runs/sun_vs_multilora/tuned/sun-s0 --save-decoder runs/sun_vs_multilora/decoder
      (stopped at its step-6 checkpoint; its state.json set to 6 steps and finished with --steps 6)
      python -m benchmarks.lib.ordinary_lora --seed 0 --steps 6 --threads 1 --out runs/sun_vs_multilora/tuned/ordinary-s0
  and seven more that really differ (the colocated record): sun-s0 tuned one step further on seed k's
  batch (another 2 of the 330 training examples; ~50 s a step on 2 cores at load ~8), k = 1..7:
      edge-export tune ... (as above, --steps 1 --n-eval 0) --seed k --init runs/sun_vs_multilora/tuned/sun-s0 \
          --out runs/sun_vs_multilora/tuned/sun-s{k}
* decoder/: the shared decoder (`--save-decoder` of the first tune: the base, fp32);
  bundle/: it as a Q4_0 GGUF (`edge-export bundle decoder bundle --onnx "" --gguf Q4_0`): the ONE
  base file both sides load (llama-server `-m`, SUN's hub decoder and prefill worker).
* gguf/{name}.gguf: each tuned adapter as a GGUF LoRA (`edge-export adapter --base bundle's GGUF
  --type F16`); tasks/{kind}/t{i}.gguf: task i's file, a copy of tuned adapter i mod K (K tuned
  adapters cycled over the tasks: tuning 64 adapters on 2 shared cores would take a day). Both
  sides load these same files, one per task, each into its own tensors (no sharing between copies:
  memory and adapter switches are those of N adapters; answers those of K). Delete tasks/ when the
  tuned set changes (an existing task file is kept).
"""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Dict, List, Sequence

from benchmarks.lib.results import ROOT

WORK = ROOT / "runs" / "sun_vs_multilora"
BASE = "qwen2.5-coder-0.5b"
BIN = ROOT / ".venv" / "bin"
TUNE = dict(rank=8, steps=6, batch_size=2, max_len=320, targets="q,k,v,o,gate,up,down")


def tune_command(seed: int, out: Path, save_decoder: Path = None) -> List[str]:
    cmd = [str(BIN / "edge-export"), "tune", "--base", BASE, "--task", "tools", "--adapter", "lora",
           "--rank", TUNE["rank"], "--targets", TUNE["targets"], "--steps", TUNE["steps"],
           "--batch-size", TUNE["batch_size"], "--max-len", TUNE["max_len"], "--ckpt-every", 3,
           "--n-eval", 8, "--eval-every", 1000, "--threads", 2, "--seed", seed, "--out", out]
    return [str(c) for c in cmd] + (["--save-decoder", str(save_decoder)] if save_decoder else [])


def tuned(work: Path = WORK) -> Dict[str, List[Path]]:
    """The finished tuned adapters by kind: {"sun-lora": [...], "lora": [...]} (seed order)."""
    done = lambda d: (d / "adapter_model.safetensors").is_file() and (d / "manifest.json").is_file()  # noqa: E731
    out = {"sun-lora": [], "lora": []}
    for d in sorted((work / "tuned").glob("*-s*")):
        if done(d):
            out["lora" if d.name.startswith("ordinary") else "sun-lora"].append(d)
    return out


def _run(cmd: Sequence, log) -> None:
    log("$ " + " ".join(str(c) for c in cmd))
    r = subprocess.run([str(c) for c in cmd], cwd=ROOT, capture_output=True, text=True)
    if r.returncode:
        raise RuntimeError(f"{cmd[0]} failed ({r.returncode}):\n{(r.stdout + r.stderr)[-3000:]}")


def bundle(work: Path = WORK, log=print) -> Path:
    """The Q4_0 bundle of the shared decoder (made once)."""
    b = work / "bundle"
    if not (b / "manifest.json").is_file():
        if not (work / "decoder").is_dir():
            raise RuntimeError(f"no shared decoder in {work / 'decoder'}: tune with --save-decoder first "
                               "(this module's docstring)")
        _run([BIN / "edge-export", "bundle", work / "decoder", b, "--onnx", "", "--gguf", "Q4_0",
              "--tokenizer", BASE], log)
    return base_gguf(b)


def base_gguf(b: Path) -> Path:
    ggufs = sorted(b.glob("*.gguf"))
    if len(ggufs) != 1:
        raise RuntimeError(f"{b}: expected one GGUF, found {[g.name for g in ggufs]}")
    return ggufs[0]


def adapter_gguf(tuned_dir: Path, base: Path, work: Path = WORK, log=print) -> Path:
    out = work / "gguf" / f"{tuned_dir.name}.gguf"
    if not out.is_file():
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_suffix(".tmp.gguf")
        _run([BIN / "edge-export", "adapter", tuned_dir, tmp, "--base", base, "--task", "tools", "--type", "F16"], log)
        tmp.replace(out)
    return out


def task_files(kind: str, n_tasks: int, base: Path, work: Path = WORK, log=print) -> List[Path]:
    """Task i's GGUF LoRA file for i < n_tasks: a copy of tuned adapter i mod K of this kind."""
    from benchmarks.lib.multilora_plan import task_name
    dirs = tuned(work)[kind]
    if not dirs:
        raise RuntimeError(f"no tuned {kind} adapter under {work / 'tuned'}: tune one first (this module's docstring)")
    sources = [adapter_gguf(d, base, work, log) for d in dirs]
    out = []
    for i in range(n_tasks):
        f = work / "tasks" / kind / f"{task_name(i)}.gguf"
        if not f.is_file():
            f.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(sources[i % len(sources)], f)
        out.append(f)
    return out


def sources_of(kind: str, n_tasks: int, work: Path = WORK) -> Dict[str, str]:
    """task name -> the tuned adapter its file copies (for the report)."""
    from benchmarks.lib.multilora_plan import task_name
    dirs = tuned(work)[kind]
    return {task_name(i): dirs[i % len(dirs)].name for i in range(n_tasks)} if dirs else {}


def heldout_items(max_chars: int, limit: int) -> List[dict]:
    """Held-out BFCL items (never trained on: export/real_tasks.bfcl_rows' eval split), prompt text
    at most max_chars (so prompt + answer fit one slot's context), in split order."""
    from export.real_tasks import bfcl_rows
    _, ev = bfcl_rows()
    items = [{"prompt": p, "answer": a, "gt": gt} for p, a, gt in ev if len(p) <= max_chars]
    return items[:limit]
