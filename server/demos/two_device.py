"""The star as two devices on one machine: the target on one core, the hub and its draft on another.

What StarSD buys is that the draft's compute leaves the target's device. On one machine the
nearest thing is cores as devices: the target runs in this process on a thread pinned to one
core; the hub (with its embedded broker, or on an external --broker) and a draft service
(`edge-agent run --role draft`) are real processes pinned to a second core. Memory bandwidth is
still shared between the cores (a second device would not share it), so this understates what a
real second device gives. `edge-hub demo` and benchmarks/star/starsd_two_device.py  (its report: benchmarks/lib/two_device_report.py) both measure with
`measure_prompt`: the target alone, then through the star, same prompt, same core, texts compared.
"""
from __future__ import annotations

import os
import re
import socket
import statistics
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, List, Optional, Sequence, Tuple

BIN = Path(sys.executable).parent


def two_cores() -> Optional[Tuple[int, int]]:
    """(target core, hub core) among the cores this process may use; None with fewer than two."""
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    return (cores[0], cores[1]) if len(cores) >= 2 else None


@contextmanager
def pinned(core: int) -> Iterator[None]:
    """Run the calling thread (and the threads it starts) on `core` only; restored on exit."""
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {core})          # pid 0: the calling thread on Linux
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RemoteStar:
    """The hub and one draft service as processes pinned to `core`; a context manager.

    broker_url None: the hub starts its embedded broker on a free loopback port. Their stderr
    goes to logdir/hub.err and logdir/draft.err (read there when a start fails)."""

    def __init__(self, draft: str, logdir: Path, core: int = 1, backend: str = "llamacpp",
                 broker_url: Optional[str] = None, threads: int = 1, ahead: bool = True,
                 dtype: Optional[str] = None, timeout: float = 180.0, drafter: str = "model",
                 p_min: Optional[float] = None):
        self.draft, self.logdir, self.core, self.backend = draft, Path(logdir), core, backend
        self.url = broker_url
        self.threads, self.ahead, self.dtype, self.timeout = threads, ahead, dtype, timeout
        self.drafter = drafter            # edge-agent run --drafter: model, suffix or hybrid
        self.p_min = p_min                # edge-agent run --draft-p-min (None: its default)
        self.procs: List[subprocess.Popen] = []

    def _start(self, name: str, *argv) -> subprocess.Popen:
        core = self.core
        p = subprocess.Popen([str(a) for a in argv], stdout=subprocess.DEVNULL,
                             stderr=open(self.logdir / f"{name}.err", "w"),
                             env=dict(os.environ, PYTHONUNBUFFERED="1"),
                             preexec_fn=lambda: os.sched_setaffinity(0, {core}))
        self.procs.append(p)
        return p

    def _wait_for(self, name: str, text: str) -> None:
        path, end = self.logdir / f"{name}.err", time.monotonic() + self.timeout
        while text not in (path.read_text(errors="replace") if path.exists() else ""):
            if any(p.poll() is not None for p in self.procs):
                raise RuntimeError(f"the star's {name} process exited; see {path}")
            if time.monotonic() > end:
                raise RuntimeError(f"{path} never said {text!r} in {self.timeout:.0f}s")
            time.sleep(0.1)

    def __enter__(self) -> "RemoteStar":
        self.logdir.mkdir(parents=True, exist_ok=True)
        try:
            if self.url is None:
                port = _free_port()
                self.url = f"mqtt://127.0.0.1:{port}"
                self._start("hub", BIN / "edge-hub", "serve", "--port", port, "--stats-every", "0")
            else:
                self._start("hub", BIN / "edge-hub", "serve", "--broker", self.url, "--stats-every", "0")
            self._wait_for("hub", "serving on")
            extra = (["--dtype", self.dtype] if self.dtype else []) + ([] if self.ahead else ["--no-ahead"])
            extra += [] if self.drafter == "model" else ["--drafter", self.drafter]
            extra += [] if self.p_min is None else ["--draft-p-min", self.p_min]
            self._start("draft", BIN / "edge-agent", "run", "--role", "draft", "-b", self.backend, "-m", self.draft,
                        "--threads", self.threads, "--broker", self.url, "--client-id", "draft1", *extra)
            self._wait_for("draft", "registered at")
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        for p in reversed(self.procs):
            p.terminate()
            try:
                p.wait(20)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        self.procs = []


def format_name(path: Path) -> str:
    """A GGUF's storage format from its file name (qwen...-q4_k_m.gguf: Q4_K_M), else the name."""
    m = re.search(r"[-.]((?:q|iq|f|bf)\d\w*)$", Path(path).stem, re.IGNORECASE)
    return m.group(1).upper() if m else Path(path).name


def two_device_part_format(fmt: Optional[str], backend: str) -> str:
    """--two-device-format: default on llama.cpp the wide format this CPU computes natively (BF16
    or F16, export.target_format.wide_format: the Q4_K_M target decodes compute-bound on a CPU, where
    no draft pays; wide weights decode memory-bound, a Jetson GPU's regime), native on torch."""
    import click
    from export.target_format import NATIVE, wide_format
    if fmt is None:
        return wide_format() if backend == "llamacpp" else NATIVE
    if fmt != NATIVE and backend != "llamacpp":
        raise click.BadParameter(f"{fmt} is a GGUF storage format: it needs --backend llamacpp",
                                 param_hint="--two-device-format")
    return fmt


@contextmanager
def two_device_target(target: str, fmt: str, shared, out=None) -> Iterator[Tuple[object, Optional[tuple]]]:
    """(engine part one measures, baseline for run_two_device). native: `shared` (the demo's first
    target), no baseline. Else the same weights stored as `fmt` (export/target_format.py writes the
    file once) in a llama.cpp engine of its own, one thread, closed on exit so that part two does
    not hold its memory; the baseline is `shared`, the file as fetched."""
    from export.target_format import NATIVE, target_gguf
    if fmt == NATIVE:
        yield shared, None
        return
    from edge.engines.llamacpp_engine import LlamaCppEngine
    from edge.model.reference import resolve_model
    src, path = resolve_model(target), target_gguf(target, fmt)
    native = format_name(src)
    (out or sys.stderr).write(
        f"target stored as {fmt} ({path.name}): the same weights as {src.name} (dequantised); {fmt} decodes "
        f"memory-bound, as on a Jetson's GPU, where a verify over k tokens costs well under k steps. The {native} "
        f"file as fetched is timed alone below, for scale (on CPUs it is usually the faster file)\n")
    engine = LlamaCppEngine(path, max_len=shared.max_len, n_seq_max=1, threads=1)
    try:
        yield engine, (native, shared)
    finally:
        engine.close()


ASKED = "-asked"      # `auto-asked`: γ=auto pricing a round as if every draft asked were sent (A/B)


def parse_modes(text: str) -> List[Tuple[str, int, bool]]:
    """'3,auto,auto:12,auto-asked' -> [(label, γ or largest γ, adaptive)]; a label ending in
    -asked is γ=auto as it was (RemoteGamma stop_aware=False: rounds priced as if every draft
    asked were sent, the service's own confidence stop), for A/B runs."""
    from edge.cli.options import STAR_GAMMA
    out = []
    for part in (x.strip() for x in str(text).split(",")):
        if part:
            g, adaptive = STAR_GAMMA.convert(part[:-len(ASKED)] if part.endswith(ASKED) else part, None, None)
            if part.endswith(ASKED) and not adaptive:
                raise ValueError(f"{part!r}: -asked is a pricing of γ=auto; give auto-asked or auto:N-asked")
            out.append((part, g, adaptive))
    if not out:
        raise ValueError("give at least one γ mode, e.g. 3 or auto")
    return out


def first_split(ref: Sequence[int], toks: Sequence[int]) -> Optional[int]:
    """Where two token lists first differ (None: identical)."""
    i = next((i for i, (a, b) in enumerate(zip(ref, toks)) if a != b), None)
    if i is None and len(ref) != len(toks):
        i = min(len(ref), len(toks))
    return i


def margin_at(engine, ids: Sequence[int], toks: Sequence[int], i: int) -> float:
    """The target's top-1 minus top-2 logit after ids + toks[:i] (where the texts split)."""
    import numpy as np
    seq = engine.new_sequence()
    try:
        row = engine.forward_last(seq, list(ids) + list(toks[:i]))[-1]
    finally:
        engine.free(seq)
    a, b = np.sort(row)[-2:]
    return float(b - a)


def measure_prompt(engine, star, ids: Sequence[int], max_new: int, modes, rounds: int = 1,
                   stop_ids: Sequence[int] = (), star_rounds: Optional[int] = None) -> dict:
    """Target alone vs the star (`star`: a StarTarget on `engine`) per γ mode, medians of `rounds`
    (the star's of its first `star_rounds`: a draft that learns from every session, the suffix
    tree, must see a prompt once, or its later runs replay the prompt's own earlier output).

    Row: alone_tok_s, alone tokens, step_ms (one target step), verify_steps {k: a target call over k
    tokens in single steps}, and per mode label 'g<label>': tok_s, speedup, acceptance,
    tokens_per_verify, answered_rounds (background probes apart: probes_answered), gamma_mean /
    gamma_zero_share (what was asked for), sent_mean (drafts the service sent a round that asked),
    wait_overhead_ms / wait_per_draft_ms (o and d of the wait the target saw, last run; RoundTrips),
    same_text, split_at, margin_at_split."""
    from edge.speculative.generate import generate_plain
    alone, runs, ref, calls = [], {m[0]: [] for m in modes}, None, {}
    for i in range(rounds):
        r = generate_plain(engine, ids, max_new, stop_ids=tuple(stop_ids))
        alone.append(r.tokens_per_s)
        ref = r.tokens
        results = [r]
        for label, g, adaptive in (modes if star_rounds is None or i < star_rounds else ()):
            star.gamma, star.adaptive, star.stop_aware = g, adaptive, not label.endswith(ASKED)
            s = star.generate(ids, max_new, stop_ids=tuple(stop_ids))
            runs[label].append((s, star.last_drafter.stats, star.last_drafter.waits))
            results.append(s)
        for res in results:                       # target calls by tokens fed; the first pays warm-ups
            for c in [c for c in res.timings if c.kind == "verify"][1:]:
                calls.setdefault(c.n_tokens, []).append(c.seconds)
    t1 = statistics.median(calls[1]) if calls.get(1) else None
    row = {"alone_tok_s": statistics.median(alone), "alone_tokens": ref, "step_ms": t1 and 1e3 * t1,
           "verify_steps": {k: statistics.median(v) / t1 for k, v in sorted(calls.items())} if t1 else {}}
    for label, rs in runs.items():
        s, d, w = rs[-1]
        split = first_split(ref, s.tokens)
        tps = statistics.median(x[0].tokens_per_s for x in rs)
        row[f"g{label}"] = {
            "tok_s": tps, "speedup": tps / row["alone_tok_s"] if row["alone_tok_s"] else float("nan"),
            "acceptance": statistics.median(x[0].acceptance_rate for x in rs),
            "tokens_per_verify": statistics.median(x[0].tokens_per_verify for x in rs),
            "answered_rounds": f"{d.answered - d.probe_answers}/{d.rounds}",   # probes apart
            "probes_answered": f"{d.probe_answers}/{d.probes}",
            "wait_overhead_ms": 1e3 * w.overhead_s, "wait_per_draft_ms": 1e3 * w.per_token_s,
            "gamma_mean": statistics.mean(s.gammas) if s.gammas else 0.0,
            "gamma_zero_share": s.gammas.count(0) / len(s.gammas) if s.gammas else 1.0,
            "sent_mean": s.n_drafted / max(1, sum(g > 0 for g in s.gammas)),   # drafts sent a round that asked
            "same_text": split is None, "split_at": split,
            "margin_at_split": None if split is None else margin_at(engine, ids, ref, split)}
    return row


def run_two_device(engine, tokenizer_fp: str, prompts: Sequence[Sequence[int]], labels: Sequence[str], draft: str,
                   *, modes, max_new: int = 48, backend: str = "llamacpp", dtype: Optional[str] = None,
                   stop_ids: Sequence[int] = (), logdir: Path = Path("runs/two_device"), out=None,
                   broker_url: Optional[str] = None, ahead: bool = True, p_min: Optional[float] = None,
                   baseline: Optional[Tuple[str, object]] = None) -> dict:
    """`edge-hub demo`'s first part: `engine` (one thread) on one core, alone and through a star
    whose hub and `draft` service run on another core; a table per prompt and mode; the rows.

    baseline (name, engine): another file of the same model (the demo: the fetched Q4_K_M when
    `engine` is its F16 copy), timed alone on the same core and prompts before the star starts, so
    the table can say what the speedup is worth in absolute tok/s. p_min: the draft service's
    --draft-p-min (None: its default)."""
    from edge.wire.link import MqttLink
    from edge.star.hub_client import HubClient
    from edge.star.target import StarTarget

    out = out or sys.stderr
    cores = two_cores()
    if cores is None:
        out.write("two devices: this machine lets us use one core only; skipped (it needs two)\n")
        return {"skipped": "one core", "rows": []}
    t_core, h_core = cores
    out.write(f"two devices: the target on core {t_core} (this process), the hub + a {Path(draft).name} draft "
              f"service on core {h_core} (processes, over MQTT); memory bandwidth is still shared ...\n")
    out.flush()
    rows = []
    base = _time_alone(baseline[1], prompts, max_new, stop_ids, t_core) if baseline else [None] * len(prompts)
    with RemoteStar(draft, logdir, core=h_core, backend=backend, broker_url=broker_url, dtype=dtype,
                    ahead=ahead, p_min=p_min) as rs, pinned(t_core):
        link = MqttLink(rs.url, client_id=f"device0-{os.getpid()}").connect(10)
        star = StarTarget(engine, HubClient(link, "device0", tokenizer_fp, engine.vocab_size),
                          gamma=max(m[1] for m in modes))
        try:
            star.generate(list(prompts[0]), 4)        # the first session pays the join and warm-ups
            if any(m[2] for m in modes):
                star.calibrate()                      # γ=auto's verify-cost curve, outside the timed runs
            for ids, label in zip(prompts, labels):
                rows.append({"label": label, **measure_prompt(engine, star, ids, max_new, modes, 1, stop_ids)})
        finally:
            star.hub.close()
            link.close()
    for row, tps in zip(rows, base):
        row["baseline_tok_s"] = tps
    for line in two_device_table(rows, modes, baseline[0] if baseline else ""):
        out.write(line + "\n")
    return {"rows": rows, "cores": [t_core, h_core]}


def _time_alone(engine, prompts, max_new: int, stop_ids, core: int) -> List[float]:
    """tok/s of `engine` alone per prompt on `core`, before the star starts: with the other core idle,
    as the device would run it with no star at all."""
    from edge.speculative.generate import generate_plain
    with pinned(core):
        generate_plain(engine, list(prompts[0]), 4)          # the first call pays the warm-ups
        return [generate_plain(engine, ids, max_new, stop_ids=tuple(stop_ids)).tokens_per_s for ids in prompts]


def two_device_table(rows: List[dict], modes, baseline_name: str = "") -> List[str]:
    """Per prompt: alone tok/s, then per mode the star's tok/s, speedup, acceptance, mean γ, text check;
    with rows' baseline_tok_s, a line of the baseline file alone next to the star's best."""
    head = f"{'prompt':<42}{'alone tok/s':>12}"
    for m in modes:
        head += f" | {'γ=' + m[0] + ' tok/s':>12}{'×':>6}{'accept':>7}{'mean γ':>7}  {'text':<15}"
    lines = [head]
    for r in rows:
        cells = f"{r['label'][:40]:<42}{r['alone_tok_s']:>12.2f}"
        for m in modes:
            x = r[f"g{m[0]}"]
            text = "same" if x["same_text"] else f"split@{x['split_at']} ({x['margin_at_split']:.2f})"
            cells += (f" | {x['tok_s']:>12.2f}{x['speedup']:>5.2f}×{x['acceptance']:>7.2f}{x['gamma_mean']:>7.1f}"
                      f"  {text:<15}")
        lines.append(cells)
    if any(not r[f"g{m[0]}"]["same_text"] for r in rows for m in modes):
        lines.append("split@i (m): the texts part at token i, where the target's top two logits differ by m "
                     "(a near-tie: a k-token verify and a one-token step round differently)")
    for m in modes if rows else ():
        sp = statistics.median(r[f"g{m[0]}"]["speedup"] for r in rows)
        lines.append(f"γ={m[0]}: median {sp:.2f}× the target alone (greedy: the same text, or a split at a near-tie)")
    if rows:
        lines.append(_why(rows, modes))
    if rows and all(r.get("baseline_tok_s") for r in rows):
        lines.append(_baseline_line(rows, modes, baseline_name))
    return lines


def _baseline_line(rows: List[dict], modes, name: str) -> str:
    """The baseline file alone next to the star's best mode, per prompt, and which is faster."""
    alone = [r["baseline_tok_s"] for r in rows]
    best = [max(r[f"g{m[0]}"]["tok_s"] for m in modes) for r in rows]
    line = (f"for scale: the {name} file alone decodes {' / '.join(f'{x:.2f}' for x in alone)} tok/s on the same "
            f"core and prompts, the other core idle (the star's best above: {' / '.join(f'{x:.2f}' for x in best)})")
    if statistics.median(alone) > statistics.median(best):
        return line + (f"; {name} is the faster file on this CPU: it decodes compute-bound, where a draft cannot "
                       "pay (--two-device-format native shows it)")
    return line


def _why(rows: List[dict], modes) -> str:
    """What decides it on this machine: a verify over k tokens in single steps, and the wait."""
    vs: dict = {}
    for r in rows:
        for k, v in r["verify_steps"].items():
            vs.setdefault(int(k), []).append(v)
    ks = [k for k in sorted(vs) if k > 1]
    waits = [r[f"g{m[0]}"]["wait_overhead_ms"] + r[f"g{m[0]}"]["wait_per_draft_ms"] * m[1]
             for r in rows for m in modes if not m[2]]
    step = statistics.median(r["step_ms"] for r in rows if r["step_ms"]) if any(r["step_ms"] for r in rows) else None
    parts = [f"a verify over {k} tokens costs {statistics.median(vs[k]):.1f} target steps" for k in ks[-2:]]
    if step:
        parts.insert(0, f"one target step {step:.0f} ms")
    if waits:
        parts.append(f"the draft's answer arrives {statistics.median(waits):.0f} ms after the request")
    return "why: " + ", ".join(parts) + (" (speculation pays when the verify costs well under k steps)" if ks else "")
