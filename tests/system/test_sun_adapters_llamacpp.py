"""SUN with prefill-only adapters on llama.cpp, over a real Mosquitto (issue 37, serving).

A SUN bundle holds the shared decoder as an F32 GGUF and two tasks' GGUF LoRA adapters
(`edge-export adapter --bundle`). `edge-agent run --role prefill --backend llamacpp --module
BUNDLE` (a real process) serves both tasks over that one base; a llama.cpp shared decoder of the
same bundle decodes. Every answer equals the in-process split run on llama.cpp: the base engine
prefills under the task's adapter (LlamaCppAdapters), the bare base decodes. A third adapter,
added to the running process by a signed AdapterAdd naming its GGUF file and sha256, is served
after; a tampered one is refused while the other tasks keep answering.
"""
from __future__ import annotations

import hashlib
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from edge.sun.adapter_control import add_adapter
from edge.sun.decoder import SharedDecoder
from edge.sun.decoder_node import DecoderNode
from harness.console_scripts import BIN, Procs, hf_model, sun_dirs
from harness.sun_adapters import trained_adapter
from harness.sun_star import KEY, Star
from harness.waiting import wait_until

llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (pip install .[llama])")
from edge.engines.llamacpp_lora import LlamaCppAdapters  # noqa: E402
from edge.engines.loader import load_engine  # noqa: E402

WORKER = "prefill-gguf"
PROMPTS = [[5, 17, 99, 3, 42, 7], [8, 120, 33, 2], [250, 11, 64, 90, 3, 17, 200]]


def quiet(*_):
    pass


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    from edge.model.sun_modules import load_module
    from export.bundle import add_adapter as bundle_adapter
    from export.bundle import build_bundle
    from export.gguf_lora import export_adapter
    root = tmp_path_factory.mktemp("sun-gguf-adapters")
    dec_dir, _ = sun_dirs(root)
    sun = root / "sun-bundle"
    build_bundle(dec_dir, sun, onnx_graphs=(), gguf_types=("F32",), tokenizer=hf_model(root / "tiny-hf"), log=quiet)
    base, _ = load_module(dec_dir)
    ggufs = {}
    for i, task in enumerate(("code", "tools", "maths")):
        d, _ = trained_adapter(base, root / "peft", task, seed=i + 1)
        if task == "maths":                          # added to the running worker later
            ggufs[task] = export_adapter(d, next(sun.glob("*.gguf")), root / "maths.gguf", task=task, log=quiet)
        else:
            bundle_adapter(sun, d, task=task, log=quiet)
    return root, sun, ggufs


def engine(sun):
    return load_engine(sun, backend="llamacpp", role="decoder", threads=1, n_seq_max=4)


def split_run(sun, task, prompt, max_new):
    """In process: llama.cpp prefills under the task's adapter, the bare base decodes."""
    pre, adapters = engine(sun), None
    try:
        adapters = LlamaCppAdapters(pre)
        path = sun / f"adapters/{task}/adapter.gguf"
        adapters.load(task, path if path.is_file() else sun.parent / f"{task}.gguf")
        seq = pre.new_sequence()
        first = int(np.argmax(adapters.prefill(seq, prompt, task)[-1]))
        blob = pre.export_kv(seq, dtype="float16", meta={"task": task})
    finally:
        if adapters is not None:
            adapters.close()
        pre.close()
    dec = SharedDecoder(engine(sun), max_batch=4)
    rid = dec.admit(blob, max_new=max_new, first_token=first)
    while rid not in dec.results:
        dec.step()
    return dec.results[rid].tokens


def test_a_llamacpp_adapter_worker_process_serves_every_bundled_task_and_a_hot_added_one(mosquitto, made):
    root, sun, ggufs = made
    want = {(t, i): split_run(sun, t, p, 10) for t in ("code", "tools", "maths") for i, p in enumerate(PROMPTS)}
    # the adapters matter: the tasks answer differently from each other on the same prompts
    assert len({tuple(want[(t, i)]) for t in ("code", "tools", "maths") for i in range(len(PROMPTS))}) > len(PROMPTS)
    key = root / "ctl.key"
    key.write_bytes(KEY)
    star = Star(mosquitto.url, (None, "", {}), decoders=(), tasks=())
    dec = SharedDecoder.from_dir(sun, threads=1, backend="llamacpp", max_batch=4)
    star._start(lambda ln: DecoderNode(dec, ln, "dec-gguf", KEY), "dec-gguf")
    ps = Procs(root)
    # no --backend: auto runs the bundle's GGUF on llama.cpp
    ps.start("prefill", BIN / "edge-agent", "run", "--role", "prefill", "--module", sun,
             "--broker", mosquitto.url, "--client-id", WORKER, "--threads", "1", "--ctl-key-file", key)
    ops = star.link("ops").connect(5)
    try:
        ps.wait_for("prefill", "up at")
        assert "prefill worker for tasks code, tools" in ps.err("prefill")
        assert wait_until(lambda: WORKER in star.router.workers and star.router.workers[WORKER].online, 30)
        assert star.router.workers[WORKER].tasks == ("code", "tools")
        c = star.client
        handles = [(t, i, c.submit(t, p, max_new=10)) for t in ("code", "tools") for i, p in enumerate(PROMPTS)]
        for t, i, h in handles:
            r = h.wait(60)
            assert r.tokens == want[(t, i)], (t, i)
            assert r.workers == [WORKER, "dec-gguf"]
        # hot add: a tampered file first (refused, the others serve), then the real one
        bad = root / "maths-bad.gguf"
        raw = bytearray(ggufs["maths"].read_bytes())
        raw[-8:] = b"\x00" * 8
        bad.write_bytes(bytes(raw))
        r = add_adapter(ops, WORKER, "maths", str(bad), hashlib.sha256(ggufs["maths"].read_bytes()).hexdigest(),
                        KEY, client="ops")
        assert not r.ok and "sha256 mismatch" in r.message and r.tasks == ["code", "tools"], r.message
        assert c.submit("code", PROMPTS[0], max_new=10).wait(60).tokens == want[("code", 0)]
        r = add_adapter(ops, WORKER, "maths", str(ggufs["maths"]),
                        hashlib.sha256(ggufs["maths"].read_bytes()).hexdigest(), KEY, client="ops")
        assert r.ok and r.tasks == ["code", "maths", "tools"], r.message
        assert wait_until(lambda: "maths" in star.router.workers[WORKER].tasks, 30)
        for i, p in enumerate(PROMPTS):
            assert c.submit("maths", p, max_new=10).wait(60).tokens == want[("maths", i)], i
        assert ps.stop("prefill") == 0, ps.err("prefill")
    finally:
        ps.close()
        star.close()


def test_auto_backend_of_a_sun_worker_is_what_its_module_is(made):
    from edge.model.bundle_manifest import BundleError
    from edge.model.resolved import resolve
    root, sun, _ = made
    # a bundle of GGUFs (a prefill worker over adapters plans its base as the decoder's artifact)
    assert resolve(str(sun), "auto", "decoder").backend == "llamacpp"
    assert resolve(str(root / "decoder"), "auto", "decoder").backend == "torch"  # tuned directories
    assert resolve(str(root / "maths"), "auto", "prefill").backend == "torch"
    with pytest.raises(BundleError, match="torch backend loads checkpoints"):   # asked, refused at the door
        resolve(str(sun), "torch", "prefill")


def test_the_llamacpp_adapter_worker_never_loads_torch(made):
    """The worker a llama.cpp device runs (base, bundled adapters, a prefill of each task) in a fresh
    interpreter: torch is never imported (import-linter cannot see it: the loader imports torch
    lazily for the torch backend)."""
    _, sun, _ = made
    code = ("import sys\n"
            "from edge.sun.adapter_prefill import AdapterPrefillWorker\n"
            f"w = AdapterPrefillWorker.open({str(sun)!r}, backend='llamacpp', threads=1)\n"
            "for i, t in enumerate(w.tasks):\n"
            "    w.submit([5, 17, 99], f'r{i}', task=t)\n"
            "outs = w.step()\n"
            "assert [o.task for o in outs] == ['code', 'tools'] and all(o.blob for o in outs), outs\n"
            "assert 'torch' not in sys.modules, 'torch was imported'\n"
            "print('ok', w.tasks)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       cwd=Path(__file__).resolve().parents[2])
    assert r.returncode == 0 and "ok ['code', 'tools']" in r.stdout, r.stderr[-2000:]


def test_llamacpp_prefill_and_decoder_share_one_model_in_one_process(mosquitto, made):
    """One model, two contexts: adapters on the prefill engine's context, none on the decoder's
    (a second context of the same model); KV handed over in process; answers equal the split run."""
    from edge.sun.adapter_llamacpp import LlamaCppAdapterBackend
    from edge.sun.colocated import colocated_nodes
    _, sun, _ = made
    want = {(t, i): split_run(sun, t, p, 10) for t in ("code", "tools") for i, p in enumerate(PROMPTS)}
    star = Star(mosquitto.url, (None, "", {}), decoders=(), tasks=())
    backend = LlamaCppAdapterBackend.from_bundle(sun, threads=1, n_seq_max=8)
    for t in ("code", "tools"):
        backend.add(t, sun, bundle=True)
    pre_link, dec_link = star.link("pre"), star.link("dec")
    pre, dec = colocated_nodes(backend, pre_link, dec_link, WORKER, "dec-local", ctl_key=KEY, max_batch=4)
    kv_seen = []
    spy = star.link("spy").connect(5)
    spy.subscribe("ss/sun/w/+/kv/+", lambda t, p: kv_seen.append(t))
    try:
        for link, node, name in ((dec_link, dec, "dec-local"), (pre_link, pre, WORKER)):
            link.connect(5)
            star.nodes.append(node.start())
            assert wait_until(lambda: name in star.router.workers and star.router.workers[name].online)
        engine = dec.decoder.engine
        assert engine._model is backend.engine._model and engine._ctx != backend.engine._ctx
        handles = [(t, i, star.client.submit(t, p, max_new=10))
                   for t in ("code", "tools") for i, p in enumerate(PROMPTS)]
        for t, i, h in handles:
            r = h.wait(60)
            assert r.tokens == want[(t, i)] and r.workers == [WORKER, "dec-local"], (t, i)
        assert pre.stats["local_kv"] == len(handles) and kv_seen == []
    finally:
        spy.close()
        star.close()
        dec.decoder.engine.close()                             # the sibling context first, then the model
        backend.adapters.close()
        backend.engine.close()


def test_an_agent_with_decoder_serves_every_task_over_one_model_through_the_broker(mosquitto, made):
    """`edge-agent run --role prefill --with-decoder` (a real process, a real Mosquitto, no other
    decoder in the star): the worker and the shared decoder join as two workers of ONE process over
    one load of the base; every answer equals the split run, and every job's KV stayed in the process."""
    root, sun, _ = made
    want = {(t, i): split_run(sun, t, p, 10) for t in ("code", "tools") for i, p in enumerate(PROMPTS)}
    key = root / "ctl-colocated.key"
    key.write_bytes(KEY)
    star = Star(mosquitto.url, (None, "", {}), decoders=(), tasks=())
    ps = Procs(root)
    worker, decoder = "prefill-both", "prefill-both-decoder"
    ps.start("both", BIN / "edge-agent", "run", "--role", "prefill", "--with-decoder", "--module", sun,
             "--broker", mosquitto.url, "--client-id", worker, "--threads", "1", "--max-batch", "4",
             "--ctl-key-file", key)
    try:
        ps.wait_for("both", "up at")
        assert f"shared decoder {decoder} (one copy of the base)" in ps.err("both")
        assert "a second context on the prefill worker's model" in ps.err("both")
        online = lambda w: w in star.router.workers and star.router.workers[w].online  # noqa: E731
        assert wait_until(lambda: online(worker) and online(decoder), 30)
        handles = [(t, i, star.client.submit(t, p, max_new=10)) for t in ("code", "tools") for i, p in enumerate(PROMPTS)]
        for t, i, h in handles:
            r = h.wait(60)
            assert r.tokens == want[(t, i)] and r.workers == [worker, decoder], (t, i)
        assert ps.stop("both") == 0, ps.err("both")
        assert f"'local_kv': {len(handles)}" in ps.err("both"), ps.err("both")[-2000:]
    finally:
        ps.close()
        star.close()


def test_with_decoder_is_refused_where_it_cannot_run(made, tmp_path):
    from click.testing import CliRunner
    from edge.cli.agent_run import run
    _, sun, _ = made
    r = CliRunner().invoke(run, ["--role", "decoder", "--with-decoder", "--module", str(sun), "--broker",
                                 "mqtt://127.0.0.1:1"])
    assert r.exit_code != 0 and "--with-decoder is for --role prefill" in r.output, r.output
    pw = tmp_path / "pw"
    pw.write_text("secret")
    # with credentials the broker's per-user ACL would drop the second id's hello: refused at the door
    r = CliRunner().invoke(run, ["--role", "prefill", "--with-decoder", "--module", str(sun), "--broker",
                                 "mqtt://127.0.0.1:1", "--username", "w", "--password-file", str(pw)])
    assert r.exit_code != 0 and "per-user ACL" in r.output, r.output


def test_the_colocated_decoder_context_is_made_before_the_adapters_and_holds_its_batch(made):
    """decode_batch (`--with-decoder` on llama.cpp): the decode context exists before any adapter loads
    (llama.cpp sizes a context's graph by every adapter on the model) and batches max_batch rows, not
    512 (its compute buffer's logits); decode_engine hands that one over once, then makes new ones."""
    from edge.engines.free_heap import give_back_free_heap
    from edge.sun.adapter_llamacpp import LlamaCppAdapterBackend
    _, sun, _ = made
    backend = LlamaCppAdapterBackend.from_bundle(sun, threads=1, n_seq_max=1, decode_batch=4)
    early = backend._decoder
    assert early is not None and backend.tasks == []
    backend.add("code", sun, bundle=True)
    engine = backend.decode_engine(4)
    other = backend.decode_engine(4)
    try:
        assert engine is early and engine._n_batch == 4 and engine.n_seq_max == 4
        assert other is not early and other._n_batch == 4
        seq = backend.prefill_rows([PROMPTS[0]], ["code"])[0]
        assert give_back_free_heap() in (True, False)          # glibc here: True; a no-op elsewhere
        seq[1].free()
    finally:
        other.close()
        engine.close()
        backend.adapters.close()
        backend.engine.close()
