"""The SUN part of `make demo`: task specialists as adapters over one base, sharing one int4 decoder over MQTT.

The specialists (server/demos/sun_specialists.py): a tiny llama trained from scratch here, and for
each of rotate / reverse / sort a prefill-only rank-8 LoRA adapter tuned against the int4 decoder
(QSUN-LoRA), ~1 min of one core on the first run, cached in --work afterwards (nothing trains
silently: every run is a progress bar). The accuracy table and, per specialist, its adapter's
bytes beside a full copy's are printed first.

Then the serving: a hub (embedded broker, SUN router), ONE prefill worker holding the fp base once
and the three adapters (edge/sun/adapter_prefill.py: rows of different tasks share one prefill
batch), and ONE shared int4 decoder, each on its own MQTT connection as on separate devices. A
client sends held-out prompts with Zipf-skewed task popularity and Poisson arrivals; the router
sends every task to the one worker that holds its adapter and the decoder batches the three tasks
together. The live table shows per task requests, exact match, TTFT and latency, and the
decoder's batch size and how many of its steps mixed tasks. At the end every served answer is
compared with the same base + adapter and decoder run in-process (`split_generate`): they must
be identical.
"""
from __future__ import annotations

import os
import sys
import threading
import time
from pathlib import Path
from typing import Dict, List, Tuple

import click
import numpy as np

from server.demos.live_table import LiveTable
from server.demos.sun_specialists import make_specialists
from server.hub import Hub

PREFILL_ID, DECODER_ID = "prefill-lora", "decoder-int4"


class _Stats:
    """What the live table shows, per task."""

    def __init__(self, tasks):
        self.lock = threading.Lock()
        self.sent = {t: 0 for t in tasks}
        self.done: Dict[str, list] = {t: [] for t in tasks}   # (correct, ttft_s, total_s)
        self.errors: List[str] = []


def _table(st: _Stats, dec, t: float, n: int) -> List[str]:
    rows = [f"SUN demo: {len(st.sent)} specialists as adapters on one prefill worker, one shared int4 decoder   "
            f"t={t:5.1f}s", f"{'task':<9}{'sent':>6}{'done':>6}{'exact':>8}{'TTFT p50':>10}{'latency p50':>13}"]
    with st.lock:
        for task, sent in st.sent.items():
            d = st.done[task]
            acc = f"{np.mean([c for c, _, _ in d]):.2f}" if d else "-"
            ttft = f"{np.median([x for _, x, _ in d]) * 1e3:.0f} ms" if d else "-"
            lat = f"{np.median([x for _, _, x in d]) * 1e3:.0f} ms" if d else "-"
            rows.append(f"{task:<9}{sent:>6}{len(d):>6}{acc:>8}{ttft:>10}{lat:>13}")
        done = sum(len(d) for d in st.done.values())
    s = dec.stats_snapshot()
    rows.append(f"{'decoder':<9}{s['steps']} steps, batch {s['batch_mean']:.1f} mean, {s['mixed_frac']:.0%} of "
                f"steps mixed tasks, {s['tokens_out']} tokens   [{done}/{n} requests]")
    return rows


def run_sun_demo(work: Path, n_requests: int = 60, rate: float = 20.0, zipf: float = 1.2, seed: int = 0,
                 max_batch: int = 32, live: bool = True, out=None) -> dict:
    """Serve n_requests over MQTT through the hub; returns a report (and checks every answer)."""
    from edge.wire.link import MqttLink
    from edge.sun.client import SunClient
    from server.demos.sun_memory import held_bytes, memory_lines, specialist_memory

    out = out or sys.stderr
    made = make_specialists(Path(work), log=lambda s: out.write(s + "\n"))
    tasks = {t.name: t for t in made["tasks"]}
    names = list(tasks)
    memory = specialist_memory(made["base"], made["adapters"])
    key = os.urandom(32)
    hub = Hub(broker="embedded", hub_id="sun-demo-hub", ctl_key=key).start()
    links, nodes = [], []
    st = _Stats(names)
    served: list = []
    try:
        prefill, decoder = _start_workers(hub, key, made, max_batch, links, nodes)
        memory["held"] = held_bytes(prefill.worker.backend)
        out.write("\n" + "\n".join(memory_lines(memory, memory["held"])) + "\n\n")
        client = SunClient(MqttLink(hub.url, client_id=f"sun-demo-client-{os.getpid()}").connect(10),
                           "demo-client").start()
        links.append(client.link)
        _wait_routes(hub, names)
        threads, t0 = _send_requests(client, tasks, st, served, n_requests, rate, zipf, seed)
        wall = _show_until_done(threads, st, decoder, t0, n_requests, live, out)
        snap, workers = decoder.stats_snapshot(), hub.snapshot()["sun"]["workers"]
        prefill_steps = list(prefill.worker.steps)
    finally:
        for node in nodes:
            node.stop()
        for ln in links:
            ln.close()
        hub.stop()
    same = _same_as_in_process(made, tasks, served)
    report = {"served": len(served), "identical_to_in_process": same, "errors": st.errors, "wall_s": wall,
              "memory": memory, "decoder": snap, "prefill_steps": prefill_steps,
              "workers": {w: (d["role"], d["tasks"]) for w, d in workers.items()},
              "served_by": sorted({tuple(r.workers) for _, _, r in served}),
              "accuracy": {t: float(np.mean([c for c, _, _ in d])) if d else None for t, d in st.done.items()}}
    _summary(report, names, n_requests, out)
    return report


def _summary(report: dict, names: List[str], n_requests: int, out) -> None:
    same, n = report["identical_to_in_process"], report["served"]
    out.write(f"\ncheck: {same}/{n} served answers identical to the in-process split run (base + adapter, "
              f"int4 decoder){'' if same == n == n_requests else '  <-- MISMATCH'}\n")
    for e in report["errors"]:
        out.write(f"error: {e}\n")
    mixed = sum(len(set(s)) > 1 for s in report["prefill_steps"]) / max(1, len(report["prefill_steps"]))
    out.write(f"one prefill worker held the base once and {len(names)} adapters: {mixed:.0%} of its prefill "
              f"batches mixed tasks (full copies: {len(names)} prefill modules, one per task)\n")
    snap = report["decoder"]
    out.write(f"one int4 decoder served {len(names)} tasks: {snap['mixed_frac']:.0%} of its batched steps held "
              f"more than one task (isolated pools would need {len(names)} decoders)\n")


def _start_workers(hub: Hub, key: bytes, made: dict, max_batch: int, links: list, nodes: list):
    """The one prefill worker (the fp base once, an adapter per task) and the one shared decoder,
    each a node on its own MQTT connection (appended to `links` and `nodes`, to be closed by the
    caller); (prefill node, decoder)."""
    from edge.wire.link import MqttLink
    from edge.model.lora.files import WEIGHTS_FILE
    from edge.model.sun_modules import read_manifest
    from edge.sun.adapter_prefill import AdapterPrefillWorker
    from edge.sun.adapter_torch import TorchAdapterBackend
    from edge.sun.decoder import SharedDecoder
    from edge.sun.decoder_node import DecoderNode
    from edge.sun.prefill_node import PrefillNode
    from edge.wire.protocol import sun_hello_topic

    def attach(node_cls, worker, wid):
        link = MqttLink(hub.url, client_id=f"{wid}-{os.getpid()}")
        node = node_cls(worker, link, wid, ctl_key=key)
        link.set_will(sun_hello_topic(wid), node.will())
        link.connect(10)             # one at a time: amqtt may drop a client connecting mid-SUBSCRIBE
        links.append(link)
        nodes.append(node.start())
        return node
    backend = TorchAdapterBackend.over_base(made["base"], made["decoder"], threads=1)
    worker = AdapterPrefillWorker(backend, kv_dtype="float32", name=PREFILL_ID)
    for name, path in made["adapters"].items():     # each checked against the sha256 its tuning recorded
        worker.add(name, path, sha256=read_manifest(path)["adapter"]["sha256"][WEIGHTS_FILE])
    prefill = attach(PrefillNode, worker, PREFILL_ID)
    decoder = SharedDecoder.from_dir(made["decoder"], threads=1, max_batch=max_batch, name=DECODER_ID)
    attach(DecoderNode, decoder, DECODER_ID)
    return prefill, decoder


def _send_requests(client, tasks: dict, st: _Stats, served: list, n_requests: int, rate: float, zipf: float,
                   seed: int) -> Tuple[List[threading.Thread], float]:
    """Held-out prompts with Zipf-skewed task popularity and Poisson arrivals, each answered on its
    own thread (into `st` and `served`); the threads, and when the first was due."""
    names = list(tasks)
    rng = np.random.default_rng(seed)
    pop = 1.0 / np.arange(1, len(names) + 1) ** zipf
    picks = rng.choice(len(names), size=n_requests, p=pop / pop.sum())

    def one(task, ex):
        try:
            r = client.submit(task, ex.prompt, max_new=tasks[task].max_new,
                              stop=list(tasks[task].stop_ids)).wait(120)
            with st.lock:
                st.done[task].append((r.tokens == list(ex.answer), r.ttft_s, r.total_s))
            served.append((task, ex, r))
        except Exception as e:       # shown at the end; the other requests go on
            with st.lock:
                st.errors.append(f"{task}: {type(e).__name__}: {e}")
    threads, t0 = [], time.monotonic()
    next_at = 0.0
    for i, k in enumerate(picks):    # Poisson arrivals
        next_at += rng.exponential(1.0 / rate)
        while time.monotonic() - t0 < next_at:
            time.sleep(0.005)
        task = names[k]
        ex = tasks[task].eval[i % len(tasks[task].eval)]
        with st.lock:
            st.sent[task] += 1
        th = threading.Thread(target=one, args=(task, ex), daemon=True)
        th.start()
        threads.append(th)
    return threads, t0


def _show_until_done(threads: list, st: _Stats, decoder, t0: float, n_requests: int, live: bool, out) -> float:
    """The live table until every request is answered, then the final one; the seconds since t0."""
    screen = LiveTable(out, live)
    while any(th.is_alive() for th in threads):
        time.sleep(0.25)
        now = time.monotonic() - t0
        screen.update(now, lambda: _table(st, decoder, now, n_requests))
    wall = time.monotonic() - t0
    screen.final(_table(st, decoder, wall, n_requests))
    return wall


def _same_as_in_process(made: dict, tasks: dict, served: list) -> int:
    """How many served answers equal the fp base under the task's adapter (prefill) and the int4
    decoder run in-process (split_generate)."""
    import torch

    from edge.model.lora.apply import LoraTransformer
    from edge.model.lora.files import load_adapter
    from edge.model.sun_modules import load_module, split_generate
    dec_model = load_module(made["decoder"])[0]
    view = LoraTransformer.over(load_module(made["base"], dtype=torch.float32)[0])
    same = 0
    for name in tasks:
        mine = [(ex, r) for t, ex, r in served if t == name]
        if not mine:
            continue
        view.add_adapter(name, load_adapter(made["adapters"][name], view.cfg))
        with torch.no_grad(), view.rows(name):
            want = split_generate(view, dec_model, [ex.prompt for ex, _ in mine], tasks[name].max_new,
                                  tasks[name].stop_ids)
        same += sum(r.tokens == w for (_, r), w in zip(mine, want))
    return same


def _wait_routes(hub: Hub, names, timeout: float = 20.0) -> None:
    """Until the hub's router has heard both workers' hellos (the prefill worker's listing every task)."""
    end = time.monotonic() + timeout
    while True:
        workers = hub.snapshot()["sun"]["workers"]
        if {PREFILL_ID, DECODER_ID} <= set(workers) and set(names) <= set(workers[PREFILL_ID]["tasks"]):
            return
        if time.monotonic() > end:
            raise click.ClickException(f"the SUN workers did not reach the hub's router: {hub.snapshot()['sun']}")
        time.sleep(0.05)


def demo_command(n_requests, rate, zipf, max_batch, work, seed):
    """`edge-hub demo-sun` (its options are in server/demos/commands.py): three task specialists, as
    adapters on one prefill worker, share one int4 decoder over MQTT (tunes tiny adapters once)."""
    import logging
    logging.getLogger("amqtt").setLevel(logging.ERROR)     # its PUBACK chatter is not ours to show
    report = run_sun_demo(Path(work), n_requests, rate, zipf, seed, max_batch)
    if report["identical_to_in_process"] != n_requests or report["errors"]:
        raise click.ClickException("the SUN demo served answers that differ from the in-process run (see above)")
