"""The suffix draft as the console scripts serve it, over a real Mosquitto: `edge-hub serve
--drafter suffix` (no model weights loaded) and `edge-agent run --role draft --drafter hybrid`
as processes, in-process targets whose greedy outputs must equal their plain decoding, and
four concurrent targets on one in-process suffix hub."""
from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch

from edge.engines.loader import open_model
from edge.speculative.generate import generate_plain
from edge.wire.link import MqttLink
from edge.star.draft_service import DraftLimits
from edge.star.hub_client import HubClient, JoinRefused
from edge.star.suffix_service import SuffixDraftService
from edge.star.target import StarTarget
from server.hub import Hub

from harness.at_once import all_at_once
from harness.tiny_hf import hf_dir

torch.set_num_threads(1)
ROOT = Path(__file__).resolve().parents[2]
BIN = ROOT / ".venv" / "bin"
PROMPTS = [[5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6], [1, 2, 3], [40, 41, 42, 40, 41], [7] * 6]


@pytest.fixture
def broker():
    """A Mosquitto of this test's own: no retained hello of another test's draft service."""
    from server.mosquitto import MosquittoBroker
    b = MosquittoBroker().start()
    yield b
    b.close()


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    d, _ = hf_dir(tmp_path_factory.mktemp("suffix") / "tiny-hf", seed=5)
    engine, tok = open_model(str(d), dtype="float64", threads=1, max_len=512)
    return d, engine, tok


def _process(tmp: Path, name: str, *args):
    import subprocess
    err = open(tmp / f"{name}.err", "wb")
    p = subprocess.Popen([str(a) for a in args], cwd=ROOT, stdout=subprocess.DEVNULL, stderr=err,
                         env=dict(os.environ, OMP_NUM_THREADS="1"))
    err.close()
    return p, tmp / f"{name}.err"


def _wait(cond, timeout=60.0, why=""):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting: {why() if callable(why) else why}")


def _joined_target(url, client, engine, tok, timeout=60.0):
    star = StarTarget(engine, HubClient(MqttLink(url, client_id=client).connect(5), client, tok.fingerprint(),
                                        engine.vocab_size), gamma=3)

    def joins():
        try:
            star.check_join()
            return True
        except (JoinRefused, TimeoutError):
            return False
    _wait(joins, timeout, "the target never joined the star")
    return star


def _stop(p):
    import signal
    p.send_signal(signal.SIGTERM)
    try:
        p.wait(20)
    except Exception:
        p.kill()
        p.wait()


@pytest.mark.parametrize("where", ["hub", "device"])
def test_suffix_and_hybrid_drafts_from_the_console_scripts_are_lossless(broker, model, tmp_path, where):
    d, engine, tok = model
    common = ["--dtype", "float64", "--threads", "1"]
    hub = None
    if where == "hub":           # the hub's own suffix draft: only the tokenizer is loaded
        p, err = _process(tmp_path, "hub", BIN / "edge-hub", "serve", "--broker", broker.url, "--drafter", "suffix",
                          "--draft-model", d, "--stats-every", "0", *common)
        _wait(lambda: "serving on" in err.read_text() or p.poll() is not None, 60, lambda: err.read_text())
    else:                        # a device's hybrid draft service takes an in-process hub's sessions
        hub = Hub(broker_url=broker.url, status_every=60.0).start()
        p, err = _process(tmp_path, "draft", BIN / "edge-agent", "run", "--role", "draft", "--broker", broker.url,
                          "--drafter", "hybrid", "--model", d, "--client-id", "dev-draft", *common)
        _wait(lambda: "registered" in err.read_text() or p.poll() is not None, 60, lambda: err.read_text())
    assert p.poll() is None, err.read_text()
    try:
        star = _joined_target(broker.url, "t1", engine, tok)
        for prompt in PROMPTS:
            got = star.generate(prompt, 24)
            assert got.tokens == generate_plain(engine, prompt, 24).tokens, (where, prompt)
        assert star.last_drafter.stats.answered > 0
        star.hub.link.close()
    finally:
        _stop(p)
        if hub is not None:
            hub.stop()
    log = err.read_text()
    assert ("with draft" in log and "(suffix)" in log) if where == "hub" else "served" in log, log


def test_four_concurrent_targets_share_one_suffix_hub(broker, model):
    _, engine, tok = model
    core = SuffixDraftService(engine.vocab_size, DraftLimits(), name="hub-draft")
    hub = Hub(broker_url=broker.url, draft_core=core, tokenizer_fp=tok.fingerprint(), status_every=60.0).start()
    from edge.engines.torch_engine import TorchEngine
    stars = [StarTarget(TorchEngine(engine.model, "target"),
                        HubClient(MqttLink(broker.url, client_id=f"t{i}").connect(5), f"t{i}", tok.fingerprint(),
                                  engine.vocab_size), gamma=3) for i in range(4)]
    try:
        results = all_at_once([lambda i=i: [stars[i].generate(p, 24).tokens for p in PROMPTS] for i in range(4)],
                              timeout=120)
        ref = [generate_plain(engine, p, 24).tokens for p in PROMPTS]
        assert all(results[i] == ref for i in range(4))
        st = core.stats.snapshot()
        assert st["requests"] > 0 and st["counters"].get("proposed_global", 0) > 0, st
    finally:
        for s in stars:
            s.hub.link.close()
        hub.stop()


def test_drafter_usage_errors_say_what_to_do():
    from click.testing import CliRunner

    from edge.cli.agent_run import run
    from server.hub_cli import main
    r = CliRunner().invoke(main, ["serve", "--drafter", "suffix"])
    assert r.exit_code == 2 and "needs --draft-model" in r.output
    r = CliRunner().invoke(run, ["--role", "target", "--broker", "mqtt://127.0.0.1:1", "--model", "x",
                                 "--drafter", "hybrid"])
    assert r.exit_code == 2 and "is for --role draft" in r.output
    r = CliRunner().invoke(run, ["--role", "draft", "--broker", "mqtt://127.0.0.1:1", "--model", "/nonexistent",
                                 "--drafter", "suffix"])
    assert r.exit_code == 1 and "no such model file or directory: /nonexistent" in r.output   # resolved at the door
