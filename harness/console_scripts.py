"""The console scripts (`edge-hub`, `edge-agent`) as real processes, and the tiny saved models they load.

`Procs` starts processes by name with their output in files (a full pipe would block them) and
stops them with SIGTERM; `hf_model` writes a tiny random float64-ready llama as a Hugging Face
dir, `sun_dirs` a SUN decoder and one specialist as export.tune writes them; `sun_reference`
is the in-process answer a SUN request through the processes must equal. Used by
tests/system/test_cli_wiring.py and its neighbours, harness/star_processes.py (process
faults), harness/netns_star.py (the star in network namespaces) and benchmarks' fault runs.
"""
from __future__ import annotations

import copy
import json
import os
import signal
import subprocess
from pathlib import Path

import torch

from edge.model.transformer import Transformer, tiny_config
from harness.tiny_hf import tokenizer_dir
from harness.waiting import wait_until

ROOT = Path(__file__).resolve().parents[1]
BIN = ROOT / ".venv" / "bin"
PW = "pw-for-tests"
PROMPT = "the the he"
MAX_NEW = 24


def hf_model(d: Path, seed: int = 5, vocab_size: int = 262, save_tokenizer=tokenizer_dir) -> Path:
    """A tiny random llama as a Hugging Face dir (config.json, model.safetensors, and the tokenizer
    save_tokenizer(d) writes: by default harness/tiny_hf.py's, for a vocabulary of 262)."""
    from safetensors.torch import save_file
    torch.manual_seed(seed)
    m = Transformer(tiny_config(vocab_size=vocab_size)).eval()
    for p in m.parameters():
        p.data.normal_(0, 0.2)
    d.mkdir(parents=True)
    (d / "config.json").write_text(json.dumps(m.cfg.to_hf()))
    save_file({k: v.contiguous() for k, v in m.state_dict().items()}, str(d / "model.safetensors"))
    save_tokenizer(d)
    return d


def sun_dirs(root: Path) -> tuple[Path, Path]:
    """(shared decoder dir, 'maths' specialist dir) as export.tune writes them."""
    from edge.model.sun_modules import save_module, weights_fingerprint
    from export.tune import save_decoder
    torch.manual_seed(0)
    base = Transformer(tiny_config(vocab_size=262)).double().eval()   # tokenizer_dir's vocabulary (a GGUF needs it)
    for p in base.parameters():
        p.data.normal_(0, 0.2)
    spec = copy.deepcopy(base)                     # a stand-in for a tuned prefill module
    g = torch.Generator().manual_seed(10)
    for p in spec.parameters():
        p.data.add_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.05)
    fp = weights_fingerprint(base)
    save_decoder(root / "decoder", base, "fp32", fp)
    save_module(root / "maths", spec, {"kind": "sun-prefill", "decoder_fingerprint": fp, "task": "maths"})
    return root / "decoder", root / "maths"


class Procs:
    """Console-script processes with their output in files (a full pipe would block them)."""

    def __init__(self, root: Path):
        self.root, self.procs = root, {}
        self.env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONIOENCODING="utf-8")

    def start(self, name: str, *args: str) -> subprocess.Popen:
        out, err = open(self.root / f"{name}.out", "wb"), open(self.root / f"{name}.err", "wb")
        p = subprocess.Popen([str(a) for a in args], cwd=ROOT, env=self.env, stdout=out, stderr=err)
        out.close()
        err.close()
        self.procs[name] = p
        return p

    def err(self, name: str) -> str:
        return (self.root / f"{name}.err").read_text(errors="replace")

    def out(self, name: str) -> str:
        return (self.root / f"{name}.out").read_bytes().decode("utf-8")

    def wait_for(self, name: str, text: str, timeout: float = 60.0) -> None:
        def said() -> bool:
            p = self.procs[name]
            assert p.poll() is None or text in self.err(name), f"{name} exited {p.returncode}:\n{self.err(name)}"
            return text in self.err(name)
        assert wait_until(said, timeout), f"{name} did not say {text!r}:\n{self.err(name)}"

    def stop(self, name: str, timeout: float = 20.0) -> int:
        p = self.procs[name]
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
            try:
                return p.wait(timeout)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
                return -9
        return p.returncode

    def close(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.kill()
                p.wait()


def greedy_text(engine, tok, prompt: str, max_new: int) -> tuple:
    """The prompt's plain greedy continuation in this process, what a target process must print:
    (its tokens, their text)."""
    from edge.speculative.generate import generate_plain
    ref = generate_plain(engine, tok.encode(prompt, add_special=True), max_new, stop_ids=tuple(tok.eos_ids)).tokens
    stream = tok.decode_stream(skip_special=True)
    return ref, "".join(stream.put(t) for t in ref)


def sun_reference(maths_dir, dec_dir, prompt, max_new):
    """The tokens the same directories give in-process (PrefillWorker -> SharedDecoder): what a
    SUN request through the processes must answer."""
    from edge.sun.decoder import SharedDecoder
    from edge.sun.prefill import PrefillWorker
    out = PrefillWorker.from_dir(maths_dir, threads=1).prefill(prompt)
    dec = SharedDecoder.from_dir(dec_dir, threads=1)
    rid = dec.admit(out.blob, max_new=max_new, first_token=out.first_token)
    while rid not in dec.results:
        dec.step()
    return dec.results[rid].tokens
