"""`edge-agent run --backend`: every role as a real process on an exported artifact.

One tiny llama is bundled (`export.bundle`) as an ONNX model graph and an F32
GGUF; a SUN decoder is bundled as an F32 GGUF and one specialist as an ONNX
prefill graph. Over Mosquitto and an in-process hub:

* a draft service on llama.cpp drafts for a target on onnxruntime; the
  target's text must equal its own plain greedy text (lossless: every token is
  the argmax of the target's own logits, whatever the draft backend), and the
  draft service must have answered;
* a SUN request goes through an ONNX prefill worker and a llama.cpp shared
  decoder (the KV blob crosses runtimes and processes) and must give the tokens
  the same two artifacts give in-process.
"""
from __future__ import annotations

import time

import pytest

from edge.wire.link import MqttLink
from server.hub import Hub
from harness.console_scripts import BIN, PROMPT, Procs, greedy_text, hf_model as _hf_model, sun_dirs as _sun_dirs

MAX_NEW = 20


@pytest.fixture(scope="module")
def agents(tmp_path_factory, mosquitto):
    pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (pip install .[llama])")
    from export.bundle import build_bundle
    root = tmp_path_factory.mktemp("cli-backends")
    model = _hf_model(root / "tiny-hf")
    dec_dir, maths_dir = _sun_dirs(root)
    bundle, sun = root / "bundle", root / "sun-bundle"
    quiet = lambda *_: None  # noqa: E731
    build_bundle(model, bundle, onnx_graphs=("model",), gguf_types=("F32",), log=quiet)
    build_bundle(dec_dir, sun, onnx_graphs=(), gguf_types=("F32",), tokenizer=model, log=quiet)
    build_bundle(maths_dir, sun, onnx_graphs=("prefill",), log=quiet)
    hub = Hub(broker_url=mosquitto.url).start()
    ps = Procs(root)
    agent = [BIN / "edge-agent", "run", "--broker", mosquitto.url, "--threads", "1"]
    try:
        ps.start("draft", *agent, "--role", "draft", "--backend", "llamacpp", "--model", bundle,
                 "--client-id", "draft-llamacpp", "--no-ahead")
        ps.start("prefill", *agent, "--role", "prefill", "--backend", "onnx", "--module", sun,
                 "--client-id", "prefill-onnx")
        ps.start("decoder", *agent, "--role", "decoder", "--backend", "llamacpp", "--module", sun,
                 "--client-id", "decoder-llamacpp", "--max-batch", "4", "--repack", "off")
        ps.wait_for("draft", "registered at")
        ps.start("target", *agent, "--role", "target", "--backend", "onnx", "--model", bundle,
                 "--client-id", "target-onnx", "--prompt", PROMPT, "-n", MAX_NEW, "-g", "3")
        yield ps, mosquitto.url, bundle, sun
    finally:
        ps.close()
        hub.stop()


def test_onnx_target_with_a_llamacpp_draft_service(agents):
    from edge.engines.loader import open_model
    ps, _, bundle, _ = agents
    engine, tok = open_model(str(bundle), backend="onnx", role="target", dtype="float32", threads=1, max_len=4096)
    assert engine.name.startswith("onnx")
    ref, text = greedy_text(engine, tok, PROMPT, MAX_NEW)
    assert len(ref) >= 8, "the reference should be long enough to need several draft rounds"
    assert ps.procs["target"].wait(90) == 0, ps.err("target") + ps.err("draft")
    assert ps.out("target") == text
    err = ps.err("target")
    assert "on onnx" in err and "joined the star" in err, err
    answered = int(err.split("answered ")[1].split("/")[0])
    assert answered > 0, f"the llama.cpp draft service never answered:\n{err}\n{ps.err('draft')}"
    assert "on llamacpp" in ps.err("draft"), ps.err("draft")


def test_sun_request_through_onnx_prefill_and_llamacpp_decoder_processes(agents):
    from edge.sun.decoder import SharedDecoder
    from edge.sun.prefill import PrefillWorker
    from edge.sun.client import SunClient
    ps, url, _, sun = agents
    prompt = [5, 17, 99, 3, 42, 7]
    worker = PrefillWorker.from_dir(sun, threads=1, backend="onnx")
    assert worker.task == "maths"                 # from the bundle's artifact, as the agent finds it
    out = worker.prefill(prompt)
    dec = SharedDecoder.from_dir(sun, threads=1, backend="llamacpp", max_batch=4, engine_kw={"extra_bufts": False})
    rid = dec.admit(out.blob, max_new=16, first_token=out.first_token)
    while rid not in dec.results:
        dec.step()
    ref = dec.results[rid].tokens
    ps.wait_for("prefill", "up at")
    ps.wait_for("decoder", "up at")
    assert "weight repacking off (off as asked)" in ps.err("decoder")     # --repack reaches a SUN worker
    client = SunClient(MqttLink(url).connect(10), "app-backends").start()
    try:
        end = time.monotonic() + 30
        while True:                                # the router learns the workers from their hellos
            try:
                r = client.generate("maths", prompt, max_new=16, timeout=30)
                break
            except Exception:
                if time.monotonic() > end:
                    raise
                time.sleep(0.2)
        assert r.tokens == ref
        assert list(r.workers) == ["prefill-onnx", "decoder-llamacpp"]
    finally:
        client.close()
        client.link.close()
    for name in ("prefill", "decoder", "draft"):
        assert ps.stop(name) == 0, ps.err(name)


def test_backend_errors_name_the_fix(tmp_path):
    from click.testing import CliRunner

    from edge.cli.agent_run import run
    module = tmp_path / "not-a-bundle"
    module.mkdir()
    r = CliRunner().invoke(run, ["--role", "decoder", "--broker", "mqtt://127.0.0.1:1", "--backend", "onnx",
                                 "--module", str(module)])
    assert r.exit_code != 0 and "edge-export bundle" in r.output, r.output
    from server.hub_cli import main as hub_main
    r = CliRunner().invoke(hub_main, ["serve", "--broker", "mqtt://127.0.0.1:1", "--sun-decoder", str(module),
                                      "--sun-backend", "llamacpp"])
    assert r.exit_code != 0 and "--sun-decoder" in r.output and "edge-export bundle" in r.output, r.output
