"""SUN with prefill-only adapters over a real Mosquitto (issue 37, serving), torch backend.

One prefill worker holds a tiny random float64 base once and a LoRA adapter per task; the shared
decoder is that base. Every answer is held to the in-process split run: prefill under the task's
adapter, greedy decode on the frozen base (harness/sun_adapters.py's Reference).

* requests of three tasks, all through the one worker, equal the split run;
* an adapter added to the running worker (AdapterAdd, signed with the ctl key): the new task is
  refused before, announced and served after;
* bad adapters sent to the running worker are refused with why while another task's requests,
  in flight and after, keep completing; an AdapterAdd signed with another key is dropped.
"""
from __future__ import annotations

import hashlib
import shutil

import pytest
import torch

from edge.model.sun_modules import weights_fingerprint
from edge.sun.adapter_control import AdapterAddTimeout, add_adapter
from edge.sun.adapter_prefill import AdapterPrefillWorker
from edge.sun.adapter_torch import TorchAdapterBackend
from edge.sun.client import SunRequestError
from edge.sun.prefill_node import PrefillNode
from harness.sun_adapters import Reference, edit_config, trained_adapter
from harness.sun_star import KEY, Star, prompts
from harness.tiny_models import random_model
from harness.waiting import wait_until

TASKS = ("code", "maths", "tools")
WORKER = "prefill-lora"


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    base = random_model(5)
    dirs = {t: trained_adapter(base, root, t, seed=i + 1) for i, t in enumerate(TASKS)}
    return base, weights_fingerprint(base), dirs, Reference(base, {t: d for t, (d, _) in dirs.items()})


def adapter_star(url, made, tasks):
    base, fp, dirs, _ = made
    star = Star(url, (base, fp, {}), tasks=())
    worker = AdapterPrefillWorker(TorchAdapterBackend(base, fp), kv_dtype="float64", name=WORKER)
    for t in tasks:
        worker.add(t, *dirs[t])
    star.prefills[WORKER] = star._start(lambda ln: PrefillNode(worker, ln, WORKER, KEY, chunk_bytes=1500), WORKER)
    return star, star.prefills[WORKER]


def test_every_task_through_one_adapter_worker_equals_the_split_run(mosquitto, made):
    star, node = adapter_star(mosquitto.url, made, TASKS)
    try:
        assert star.router.workers[WORKER].tasks == TASKS and star.router.tasks() == list(TASKS)
        jobs = list(zip(TASKS * 3, prompts(9, seed=11)))
        handles = [star.client.submit(t, p, max_new=8) for t, p in jobs]
        for h, (t, p) in zip(handles, jobs):
            r = h.wait(30)
            assert r.tokens == made[3].expect(t, p, 8), t
            assert r.workers == [WORKER, "dec-a"]
        assert node.stats["jobs"] == 9 and node.worker.engine.vocab_size == 256
        assert {t for step in node.worker.steps for t in step} == set(TASKS)
    finally:
        star.close()


def test_an_adapter_added_while_serving_is_announced_and_served(mosquitto, made, tmp_path):
    """Through `edge-agent add-adapter` (its sha256 computed from the directory): a wrong digest is
    refused (exit 1, the reason printed), the right one loads and the task is served."""
    from click.testing import CliRunner

    from edge.cli.agent import main as agent_cli
    _, _, dirs, ref = made
    star, node = adapter_star(mosquitto.url, made, ("maths",))
    key = tmp_path / "ctl.key"
    key.write_bytes(KEY)
    cli = ["add-adapter", WORKER, "tools", str(dirs["tools"][0]), "--broker", mosquitto.url, "--ctl-key-file", str(key),
           "--client-id", "ops"]
    try:
        p = prompts(1, seed=5)[0]
        with pytest.raises(SunRequestError, match="no prefill worker serves task 'tools'"):
            star.client.submit("tools", p, max_new=4).wait(20)
        r = CliRunner().invoke(agent_cli, cli + ["--sha256", "ab" * 32])
        assert r.exit_code == 1 and "REFUSED" in r.output and "is not the expected" in r.output, r.output
        r = CliRunner().invoke(agent_cli, cli)
        assert r.exit_code == 0 and "loaded" in r.output and "serves: maths, tools" in r.output, r.output
        assert wait_until(lambda: "tools" in star.router.workers[WORKER].tasks)
        assert star.client.submit("tools", p, max_new=8).wait(30).tokens == ref.expect("tools", p, 8)
        assert star.client.submit("maths", p, max_new=8).wait(30).tokens == ref.expect("maths", p, 8)
        assert node.stats["adapters_added"] == 1 and node.stats["adapters_refused"] == 1
    finally:
        star.close()


def test_bad_adapters_are_refused_with_why_while_other_tasks_complete(mosquitto, made, tmp_path):
    base, _, dirs, ref = made
    star, node = adapter_star(mosquitto.url, made, ("maths",))
    ops = star.link("ops").connect(5)
    good, sha = dirs["tools"]
    rank = shutil.copytree(good, tmp_path / "rank")
    edit_config(rank, r=8)
    module = shutil.copytree(good, tmp_path / "module")
    edit_config(module, target_modules=["q_proj", "x_proj"])
    other, other_sha = trained_adapter(random_model(6, intermediate_size=96), tmp_path, "other", seed=3,
                                       record_base=False)
    corrupt = shutil.copytree(good, tmp_path / "corrupt")
    (corrupt / "adapter_model.safetensors").write_bytes(b"not a safetensors file")
    bad = [(good, "0" * 64, "is not the expected"), (rank, sha, "wrong rank"), (module, sha, "x_proj"),
           (other, other_sha, "wrong base shape"),
           (corrupt, hashlib.sha256(b"not a safetensors file").hexdigest(), "safetensors")]
    try:
        ps = prompts(len(bad) + 1, seed=21)
        long = star.client.submit("maths", ps[-1], max_new=120)     # in flight through every refusal
        for (path, digest, says), p in zip(bad, ps):
            r = add_adapter(ops, WORKER, "tools", str(path), digest, KEY, client="ops")
            assert not r.ok and says in r.message and "refused" in r.message, r.message
            assert r.tasks == ["maths"]
            assert star.client.submit("maths", p, max_new=6).wait(30).tokens == ref.expect("maths", p, 6)
        assert long.wait(60).tokens == ref.expect("maths", ps[-1], 120)
        assert node.stats["adapters_refused"] == len(bad) and star.router.workers[WORKER].tasks == ("maths",)
        # signed with another key: dropped unread, never answered
        with pytest.raises(AdapterAddTimeout):
            add_adapter(ops, WORKER, "tools", str(good), sha, b"x" * 32, client="ops", timeout=3)
        assert node.dropped.get("ctl_auth", 0) >= 1 and node.worker.tasks == ["maths"]
    finally:
        star.close()


def test_edge_agent_prefill_process_serves_its_adapter_options(mosquitto, tmp_path):
    """`edge-agent run --role prefill --module DECODER_DIR --adapter T=DIR ...` (a real process, torch):
    both tasks answer as the split run; a bad --adapter among them is refused at start, the rest serve."""
    from edge.model.sun_modules import load_module
    from edge.sun.decoder import SharedDecoder
    from edge.sun.decoder_node import DecoderNode
    from harness.console_scripts import BIN, Procs, sun_dirs
    dec_dir, _ = sun_dirs(tmp_path)
    base, _ = load_module(dec_dir)
    dirs = {t: trained_adapter(base, tmp_path / "peft", t, seed=i + 1)[0] for i, t in enumerate(("code", "maths"))}
    other = trained_adapter(random_model(6, intermediate_size=96), tmp_path, "other", seed=3, record_base=False)[0]
    ref = Reference(base, dirs)
    key = tmp_path / "ctl.key"
    key.write_bytes(KEY)
    star = Star(mosquitto.url, (None, "", {}), decoders=(), tasks=())
    dec = SharedDecoder.from_dir(dec_dir, threads=1)
    star._start(lambda ln: DecoderNode(dec, ln, "dec-a", KEY), "dec-a")
    ps = Procs(tmp_path)
    ps.start("prefill", BIN / "edge-agent", "run", "--role", "prefill", "--module", dec_dir, "--broker", mosquitto.url,
             "--client-id", WORKER, "--threads", "1", "--ctl-key-file", key, "--adapter", f"code={dirs['code']}",
             "--adapter", f"tools={other}", "--adapter", f"maths={dirs['maths']}")
    try:
        ps.wait_for("prefill", "up at")
        err = ps.err("prefill")
        assert "prefill worker for tasks code, maths" in err and "adapter for task 'tools' refused" in err, err
        assert "wrong base shape" in err, err
        assert wait_until(lambda: WORKER in star.router.workers and star.router.workers[WORKER].online, 30)
        for t, p in zip(("code", "maths", "code"), prompts(3, seed=4)):
            assert star.client.submit(t, p, max_new=8).wait(60).tokens == ref.expect(t, p, 8), t
        assert ps.stop("prefill") == 0, ps.err("prefill")
    finally:
        ps.close()
        star.close()


def test_a_colocated_prefill_and_decoder_share_one_base_and_hand_kv_over_in_process(mosquitto, made):
    """One process, one base: the prefill view and the decoder read the same weight storage; the
    router's jobs come over the star, their KV never does; answers equal the split run."""
    from edge.sun.colocated import colocated_nodes, shares_weights
    base, fp, dirs, ref = made
    star = Star(mosquitto.url, (base, fp, {}), decoders=(), tasks=())
    backend = TorchAdapterBackend(base, fp)
    pre_link, dec_link = star.link("pre"), star.link("dec")
    pre, dec = colocated_nodes(backend, pre_link, dec_link, WORKER, "dec-local", [(t, dirs[t][0]) for t in TASKS],
                               ctl_key=KEY, kv_dtype="float64", max_batch=8)
    spy = star.link("spy").connect(5)
    kv_seen = []
    spy.subscribe("ss/sun/w/+/kv/+", lambda t, p: kv_seen.append(t))
    try:
        for link, node, name in ((dec_link, dec, "dec-local"), (pre_link, pre, WORKER)):
            link.connect(5)
            star.nodes.append(node.start())
            assert wait_until(lambda: name in star.router.workers and star.router.workers[name].online)
        assert shares_weights(backend, dec) and pre.worker.tasks == list(TASKS)
        jobs = list(zip(TASKS * 2, prompts(6, seed=31)))
        handles = [star.client.submit(t, p, max_new=8) for t, p in jobs]
        for h, (t, p) in zip(handles, jobs):
            r = h.wait(30)
            assert r.tokens == ref.expect(t, p, 8) and r.workers == [WORKER, "dec-local"], t
        assert pre.stats["local_kv"] == len(jobs) and dec.stats["admitted"] == len(jobs)
        assert kv_seen == []                               # no KV crossed the broker
        assert all(torch.equal(a, b) for a, b in zip(base.parameters(), random_model(5).parameters()))
    finally:
        spy.close()
        star.close()
