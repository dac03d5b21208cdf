"""The StarSD star on one machine: one hub with one draft service, N targets.

`run_star_demo` starts a hub (embedded MQTT broker + the draft service on
Qwen2.5-Coder-0.5B), joins N targets (Qwen2.5-Coder-1.5B, each its own
engine; with llama.cpp the GGUF is mmap'd, so the N copies share the weights
in memory) and lets each generate from its own prompt concurrently, through
the real protocol. A live table shows per target tokens, tok/s and
acceptance, and the draft's busy ratio and batch size; a plot is written at
the end. With `check` every target then decodes alone from the same prompt
and its output is compared with its StarSD output (greedy: the same text).

The hub is the one piece of the demo that is not a device role: it is made
by `start_hub` (default: server.hub.Hub, imported lazily so that importing
the edge package never imports the hub).
"""
from __future__ import annotations

import os
import sys
import threading
import time
from pathlib import Path
from typing import Callable, List, Optional, Sequence, Tuple

import click

from edge.engines.base import Engine
from edge.engines.counting import CountingEngine
from edge.speculative.sampling import GREEDY
from server.demos.live_table import LiveTable
from server.hub import Hub

# MT-bench first turns (questions 122, 127, 104, 141; Apache-2.0), coding first
DEMO_PROMPTS = [
    "Write a C++ program to find the nth Fibonacci number using recursion.",
    "Write a function to find the majority element in a given integer array using the Boyer-Moore "
    "Voting Algorithm.",
    "David has three sisters. Each of them has one brother. How many brothers does David have?",
    "In the field of quantum physics, what is superposition, and how does it relate to the phenomenon "
    "of quantum entanglement?",
]

MIN_RATE_S = 1.0        # no live rate over a shorter span


def _rate(v: Optional[float]) -> str:
    return "-" if v is None else f"{v:.2f}"


def _snippet(text: Optional[str], width: int = 96) -> str:
    """One line of a target's text: newlines shown as ⏎, cut at `width`."""
    one = " ⏎ ".join(ln.strip() for ln in (text or "").strip().splitlines() if ln.strip())
    return one if len(one) <= width else one[:width - 1] + "…"


class _Target:
    def __init__(self, name: str, engine: Engine, prompt: List[int], label: str):
        self.name, self.engine, self.prompt, self.label = name, CountingEngine(engine), prompt, label
        self.tokens: List[int] = []
        self.t_first: Optional[float] = None
        self.t_last: Optional[float] = None
        self.result = None
        self.error: Optional[str] = None
        self.star = None

    def on_token(self, t: int) -> None:
        now = time.monotonic()
        self.t_first = self.t_first or now
        self.t_last = now
        self.tokens.append(int(t))

    def tps(self) -> Optional[float]:
        """Decode tok/s: the generation's own once it is done; live, over at least MIN_RATE_S (drafts
        accepted in one round arrive microseconds apart: a rate over them would read 300000)."""
        if self.result is not None:
            return self.result.tokens_per_s
        if self.t_first is None or self.t_last is None or self.t_last - self.t_first < MIN_RATE_S:
            return None
        return (len(self.tokens) - 1) / (self.t_last - self.t_first)


def _local_hub(draft_engine: Engine, tokenizer_fp: str, broker: str, gamma: int):
    from edge.star.draft_service import DraftLimits
    return Hub(broker=broker, draft_engine=draft_engine, tokenizer_fp=tokenizer_fp, hub_id="demo-hub",
               limits=DraftLimits(max_gamma=max(8, gamma), ahead=True, join=True,
                                  evict_after_s=600)).start()


class _Window:
    """Draft busy ratio and mean batch over the last `span` seconds (a batch's time is
    booked when it ends, so short windows would flicker between 0 and 100%)."""

    def __init__(self, stats, span: float = 4.0):
        self.stats, self.span = stats, span
        self.hist: List[tuple] = []          # (time, busy_s, total_s, batches, requests)

    def look(self, now: float) -> dict:
        s = self.stats.snapshot()
        total = s["busy_s"] + s["idle_s"] + s["ahead_s"]
        nb = sum(v["batches"] for v in s["s_of_d"].values())
        nr = sum(int(k) * v["batches"] for k, v in s["s_of_d"].items())
        self.hist.append((now, s["busy_s"], total, nb, nr))
        old = next((h for h in self.hist if h[0] >= now - self.span), self.hist[0])
        if old is self.hist[-1] and len(self.hist) > 1:
            old = self.hist[-2]
        db, dt, dn, dr = (self.hist[-1][i] - old[i] for i in range(1, 5))
        sizes = list(self.stats.batch_sizes)
        return {"busy": db / dt if dt > 0 else 0.0, "busy_total": s["busy_ratio"],
                "batch": dr / dn if dn else float("nan"), "batch_now": sizes[-1] if sizes else 0,
                "batch_mean": s["batch_size_mean"], "requests": s["requests"], "ahead": s["ahead_tokens"],
                "span": self.span}


def _table(targets: List[_Target], d: dict, max_new: int, t: float, head: str) -> List[str]:
    rows = [f"{head}   t={t:5.1f}s",
            f"{'target':<9}{'prompt':<42}{'tokens':>9}{'tok/s':>8}{'accept':>8}{'tok/round':>10}"]
    for x in targets:
        e = x.engine
        acc = f"{e.accepted / e.drafted:.2f}" if e.drafted else "-"
        tpr = f"{len(x.tokens) / e.rounds:.2f}" if e.rounds else "-"
        state = "done" if x.result is not None else ("ERROR" if x.error else "")
        rows.append(f"{x.name:<9}{x.label[:40]:<42}{len(x.tokens):>4}/{max_new:<4}{_rate(x.tps()):>8}{acc:>8}"
                    f"{tpr:>10} {state}")
    if d.get("span"):
        busy = (f"busy {d['busy']:4.0%} (last {d['span']:.0f}s), {d['busy_total']:4.0%} overall   batch "
                f"{d['batch_now']} now, {d['batch']:.1f} (last {d['span']:.0f}s), {d['batch_mean']:.1f} mean")
    else:
        busy = f"busy {d['busy_total']:4.0%} overall   batch {d['batch_mean']:.1f} mean"
    rows.append(f"{'draft':<9}{busy}   requests {d['requests']}   drafted ahead {d['ahead']}")
    return rows


def run_star_demo(draft_engine: Engine, target_engines: Sequence[Engine], tokenizer_fp: str,
                  prompts: Sequence[Sequence[int]], *, labels: Optional[Sequence[str]] = None, max_new: int = 48,
                  gamma: int = 4, adaptive: bool = False, stop_ids: Sequence[int] = (), check: bool = False,
                  plot_path: Optional[os.PathLike] = None, live: bool = True, refresh_s: float = 0.5,
                  out=None, broker: str = "embedded", head: str = "StarSD demo",
                  decode: Optional[Callable[[List[int]], str]] = None,
                  start_hub: Optional[Callable] = None, target_nice: int = 0, notes: Sequence[str] = ()) -> dict:
    """Run N targets (one per engine, prompt i % len(prompts)) against one hub; returns a report dict.

    target_nice > 0 lowers the targets' thread priority: in a real star the hub is another
    machine; here the N targets would otherwise starve the one draft of these few cores.
    `notes` are printed under the final table (the demo's draft-memory line); with `decode`,
    one line of each target's text follows."""
    from edge.speculative.generate import generate_plain

    out = out or sys.stderr
    labels = list(labels or [f"prompt {i}" for i in range(len(prompts))])
    targets = [_Target(f"target{i}", e, list(prompts[i % len(prompts)]), labels[i % len(labels)])
               for i, e in enumerate(target_engines)]
    hub = (start_hub or _local_hub)(draft_engine, tokenizer_fp, broker, gamma)
    links, timeline = [], []
    try:
        _join(targets, hub, tokenizer_fp, gamma, adaptive, links)
        screen = LiveTable(out, live)
        wall, d = _generate(targets, hub, screen, max_new, stop_ids, refresh_s, head, timeline, target_nice)
        screen.final([*_table(targets, {**d, "span": None}, max_new, wall, head), *notes])
        if decode:
            out.write("".join(f"  {x.name}: {_snippet(decode(x.tokens))}\n" for x in targets))
        draft = hub.service.stats.snapshot()
    finally:
        for x in targets:
            if x.star is not None:
                x.star.hub.close()
        for ln in links:
            ln.close()
        hub.stop()
    report = {"wall_s": wall, "gamma": gamma, "max_new": max_new, "draft": draft, "timeline": timeline,
              "notes": list(notes),
              "targets": [{"name": x.name, "label": x.label, "tokens": x.tokens, "tok_s": x.tps(),
                           "acceptance": x.engine.accepted / x.engine.drafted if x.engine.drafted else None,
                           "tokens_per_round": len(x.tokens) / x.engine.rounds if x.engine.rounds else None,
                           "error": x.error, "text": decode(x.tokens) if decode else None} for x in targets]}
    if check:
        _check(targets, report, max_new, stop_ids, out, generate_plain, target_nice)
    if plot_path:
        report["plot"] = str(_plot(report, Path(plot_path), head))
        out.write(f"plot: {report['plot']}\n")
    return report


def _join(targets: List[_Target], hub, tokenizer_fp: str, gamma: int, adaptive: bool, links: list) -> None:
    """A StarTarget per target on its own MQTT connection (appended to `links`)."""
    from edge.wire.link import MqttLink
    from edge.star.hub_client import HubClient
    from edge.star.target import StarTarget
    for x in targets:      # one at a time: amqtt 0.12.1 may drop a client connecting during a SUBSCRIBE
        link = MqttLink(hub.url, client_id=f"{x.name}-{os.getpid()}").connect(10)
        links.append(link)
        x.star = StarTarget(x.engine, HubClient(link, x.name, tokenizer_fp, x.engine.vocab_size), gamma=gamma,
                            adaptive=adaptive)


def _generate(targets: List[_Target], hub, screen: LiveTable, max_new: int, stop_ids: Sequence[int],
              refresh_s: float, head: str, timeline: list, target_nice: int) -> Tuple[float, dict]:
    """Every target generates on its own thread, the live table showing them, each refresh_s a row
    of `timeline`; (seconds they took, the draft's window at the end)."""
    def work(x: _Target) -> None:
        _nice(target_nice)
        try:
            x.result = x.star.generate(x.prompt, max_new, GREEDY, tuple(stop_ids), x.on_token)
        except Exception as e:  # shown in the table and the report
            x.error = f"{type(e).__name__}: {e}"
    window = _Window(hub.service.stats)
    t0 = time.monotonic()
    threads = [threading.Thread(target=work, args=(x,), daemon=True) for x in targets]
    for th in threads:
        th.start()
    while any(th.is_alive() for th in threads):
        time.sleep(refresh_s)
        now = time.monotonic() - t0
        d = window.look(now)
        timeline.append((now, [len(x.tokens) for x in targets], d["busy"], d["batch"]))
        screen.update(now, lambda: _table(targets, d, max_new, now, head))
    wall = time.monotonic() - t0
    return wall, window.look(wall)


def _nice(n: int) -> None:
    """Lower this thread's priority (Linux: per-thread niceness; elsewhere a no-op)."""
    if n > 0 and hasattr(os, "setpriority") and hasattr(threading, "get_native_id"):
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), n)
        except OSError:
            pass


def _check(targets, report, max_new, stop_ids, out, generate_plain, nice: int = 0) -> None:
    """Each target decodes alone (all at once, as in the star) and compares outputs."""
    alone = [None] * len(targets)

    def work(i: int) -> None:
        _nice(nice)
        alone[i] = generate_plain(targets[i].engine.inner, targets[i].prompt, max_new, GREEDY, tuple(stop_ids))
    threads = [threading.Thread(target=work, args=(i,), daemon=True) for i in range(len(targets))]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    out.write("\ncheck: StarSD output vs the same target decoding alone (greedy)\n")
    for x, r, rep in zip(targets, alone, report["targets"]):
        same = next((i for i, (a, b) in enumerate(zip(x.tokens, r.tokens)) if a != b),
                    min(len(x.tokens), len(r.tokens)))
        equal = x.tokens == r.tokens
        rep.update(equal=equal, agree_prefix=same, alone_tokens=len(r.tokens), alone_tok_s=r.tokens_per_s)
        why = ""
        if not equal and same < min(len(x.tokens), len(r.tokens)):
            gap = _logit_gap(x.engine.inner, x.prompt + r.tokens[:same], r.tokens[same], x.tokens[same])
            rep["near_tie_gap"] = gap
            why = (f"\n    differs from token {same} on: the target's logits for its two candidates there differ "
                   f"by {gap:.3f} (a near-tie: one-token and multi-token {x.engine.name} calls round differently)")
        out.write(f"  {x.name}: {'identical' if equal else 'not identical'} ({len(x.tokens)} tokens); "
                  f"StarSD {_rate(rep['tok_s'])} tok/s vs alone {r.tokens_per_s:.2f} tok/s{why}\n")
    report["all_equal"] = all(t.get("equal") for t in report["targets"])


def _logit_gap(engine: Engine, context: List[int], a: int, b: int) -> float:
    """logit(a) - logit(b) after `context`, from one call over the whole context."""
    seq = engine.new_sequence()
    try:
        row = engine.forward(seq, context)[-1]
    finally:
        engine.free(seq)
    return float(row[a] - row[b])


def _plot(report: dict, path: Path, head: str) -> Path:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    path.parent.mkdir(parents=True, exist_ok=True)
    tl = report["timeline"]
    fig, (a0, a1) = plt.subplots(1, 2, figsize=(12, 4.2))
    if tl:
        ts = [x[0] for x in tl]
        for i, t in enumerate(report["targets"]):
            acc = "-" if t["acceptance"] is None else f"{t['acceptance']:.2f}"
            a0.plot(ts, [x[1][i] for x in tl], label=f"{t['name']}: {_rate(t['tok_s'])} tok/s, accept {acc}")
        a1.plot(ts, [100 * x[2] for x in tl], color="tab:red", label="draft busy %")
        a1b = a1.twinx()
        a1b.plot(ts, [x[3] for x in tl], color="tab:blue", label="mean batch (last 4 s)")
        a1b.set_ylabel("requests per draft batch")
        a1b.legend(loc="upper right", fontsize=8)
    a0.set_xlabel("seconds")
    a0.set_ylabel("tokens generated")
    a0.legend(fontsize=8)
    a0.set_title("targets")
    a1.set_xlabel("seconds")
    a1.set_ylabel("draft busy % (last 4 s)")
    a1.set_ylim(0, 105)
    a1.legend(loc="upper left", fontsize=8)
    a1.set_title(f"one draft service: {report['draft']['requests']} requests, mean batch "
                 f"{report['draft']['batch_size_mean']:.1f}")
    fig.suptitle(head)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def load_star_models(draft: str, target: str, n_targets: int, backend: str = "llamacpp",
                     threads: Optional[int] = None, max_len: int = 1024):
    """(draft engine, [target engines], tokenizer) for model names or GGUF paths.

    llama.cpp: every target opens the same GGUF (mmap: the weights are in memory once); the draft
    and every target get ONE thread each (`threads` for the draft): llama.cpp's threads spin at
    each barrier, so more threads than free cores make every call collapse, and here the draft
    and the targets all share this machine. torch: the targets share one loaded model (fp32)."""
    from edge.model.reference import resolve_model
    from edge.model.tokenizer import Tokenizer

    dpath, tpath = resolve_model(draft), resolve_model(target)
    tok, ttok = Tokenizer.from_gguf(dpath), Tokenizer.from_gguf(tpath)
    if tok.fingerprint() != ttok.fingerprint():
        raise ValueError(f"{draft} and {target} do not share a tokenizer: the hub would refuse the targets; "
                         "pick a draft of the target's model family")
    cores = os.cpu_count() or 2
    if backend == "llamacpp":
        from edge.engines.llamacpp_engine import LlamaCppEngine
        d = LlamaCppEngine(dpath, max_len=max_len, n_seq_max=n_targets + 2, threads=threads or 1)
        ts = [LlamaCppEngine(tpath, max_len=max_len, n_seq_max=1, threads=1) for _ in range(n_targets)]
        return d, ts, tok
    import torch
    from edge.model.checkpoint import load_model
    from edge.engines.torch_engine import TorchEngine
    dm, dck = load_model(dpath, dtype=torch.float32)
    tm, tck = load_model(tpath, dtype=torch.float32)
    d = TorchEngine(dm, dck.fingerprint, max_len=max_len, threads=threads or cores)
    return d, [TorchEngine(tm, tck.fingerprint, max_len=max_len) for _ in range(n_targets)], tok


TWO_DEVICE_PROMPTS = (1, 3)     # a coding and a prose prompt of DEMO_PROMPTS
RUNS = Path(__file__).resolve().parent.parent.parent / "runs" / "demo-star"


def _default_plot() -> Path:
    return RUNS / "star_demo.png"       # a run's output, not a tracked result: git status stays clean


def demo_command(n_targets, max_new, gamma, draft, target, backend, broker, check, plot_path, live, show_text,
                 target_nice, two_device=True, two_device_gammas="3,auto", two_device_format=None):
    """`edge-hub demo` (its options are in server/hub_cli.py): StarSD on this machine. First the
    two-device layout (one target on its own core, alone and through a star whose hub + draft run
    on another core: same text, the speedup; llama.cpp: the target stored as BF16 or F16 by default, see
    two_device_format), then one hub + draft service serving N targets at once, with the draft
    memory N co-located pairs would need and a line of each target's text."""
    import logging
    from edge.engines.base import EngineError
    from edge.model.reference import resolve_model
    from server.demos.draft_memory import draft_memory, memory_lines
    from server.demos.two_device import parse_modes, run_two_device, two_device_part_format, two_device_target
    logging.getLogger("amqtt").setLevel(logging.ERROR)     # its PUBACK chatter is not ours to show
    logging.getLogger("edge.star.hub_client").setLevel(logging.ERROR)   # a late answer to a closed session
    gamma, adaptive = gamma if isinstance(gamma, tuple) else (gamma, False)
    if n_targets < 1 or gamma < 1:
        raise click.BadParameter("--targets and --gamma must be at least 1")
    try:
        modes = parse_modes(two_device_gammas)
    except (click.BadParameter, ValueError) as e:
        raise click.BadParameter(str(e), param_hint="--two-device-gammas") from None
    two_device_format = two_device_part_format(two_device_format, backend)
    click.echo(f"loading {draft} (hub's draft) and {n_targets} x {target} ({backend}) ...", err=True)
    try:
        d, ts, tok = load_star_models(draft, target, n_targets, backend)
    except (ValueError, EngineError) as e:
        raise click.ClickException(str(e)) from None
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": p}])) for p in DEMO_PROMPTS]
    stops = sorted(tok.eos_ids)
    if two_device:
        click.echo(f"\n== 1. what the star buys: one {target} target, alone vs with the draft on another "
                   f"device ==", err=True)
        try:
            with two_device_target(target, two_device_format, ts[0]) as (engine, baseline):
                run_two_device(engine, tok.fingerprint(), [prompts[i] for i in TWO_DEVICE_PROMPTS],
                               [DEMO_PROMPTS[i] for i in TWO_DEVICE_PROMPTS], str(resolve_model(draft)),
                               modes=modes, max_new=max_new, backend=backend, stop_ids=stops, logdir=RUNS,
                               dtype=None if backend == "llamacpp" else "float32", baseline=baseline)
        except (RuntimeError, ValueError, EngineError) as e:   # a star process that did not come up: its log
            raise click.ClickException(str(e)) from None        # says why; a format llama.cpp cannot write
        click.echo(f"\n== 2. one draft for many: {n_targets} targets share the hub's draft on these same cores ==",
                   err=True)
    mem = memory_lines(draft_memory(str(resolve_model(draft)), backend, n_targets, ts[0].max_len), draft)
    label = "auto" if adaptive else gamma
    rep = run_star_demo(d, ts, tok.fingerprint(), prompts, labels=DEMO_PROMPTS, max_new=max_new, gamma=gamma,
                        adaptive=adaptive, stop_ids=stops, check=check, plot_path=plot_path or _default_plot(),
                        live=live, broker=broker, decode=lambda ids: tok.decode(ids, skip_special=True),
                        target_nice=target_nice, notes=mem,
                        head=f"StarSD: 1 x {draft} draft at the hub, {n_targets} x {target} targets "
                             f"({backend}), γ={label}")
    if show_text:
        for t in rep["targets"]:
            click.echo(f"\n--- {t['name']}: {t['label']}\n{t['text']}", err=True)
    errors = [t["error"] for t in rep["targets"] if t["error"]]
    if errors:
        raise click.ClickException(f"{len(errors)} target(s) failed: {errors[0]}")
