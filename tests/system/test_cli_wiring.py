"""The console scripts wired together: `edge-hub serve` and `edge-agent run` as real processes.

One hub (Mosquitto with the ACL, its own draft service and a shared SUN
decoder) and three agents (a StarSD target, a SUN prefill worker, a SUN
decoder) run on tiny saved models; each answer must equal the in-process
reference: the target's text its own plain greedy text, a SUN request's tokens
what the same directories give in-process (PrefillWorker -> SharedDecoder).
Float64 everywhere keeps greedy comparisons exact. The processes start in the
fixture, so their start-up overlaps the in-process references.
"""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from edge.wire.link import MqttLink
from edge.sun.client import SunClient, SunRequestError
from harness.console_scripts import BIN, MAX_NEW, PROMPT, PW, Procs, greedy_text
from harness.console_scripts import hf_model as _hf_model, sun_dirs as _sun_dirs, sun_reference as _sun_reference
from harness.waiting import wait_until


@pytest.fixture(scope="module")
def star(tmp_path_factory):
    """A hub process (Mosquitto + ACL, draft service, SUN decoder) and its agents."""
    from server.broker import find_free_port
    root = tmp_path_factory.mktemp("cli")
    model = _hf_model(root / "tiny-hf")
    dec_dir, maths_dir = _sun_dirs(root)
    port = find_free_port()
    url = f"mqtt://127.0.0.1:{port}"
    ps = Procs(root)
    key = root / "ctl.key"                         # every control message signed with one shared key
    key.write_bytes(os.urandom(24).hex().encode())
    ps.ctl_key = key.read_bytes()
    signed = ["--ctl-key-file", key]
    common = ["--threads", "1", "--dtype", "float64"]
    users = [f"{n}:{r}:{PW}" for n, r in (("dev1", "client"), ("prefill-maths", "sun"),
                                           ("dec-agent", "sun"), ("app", "client"), ("monitor", "hub"))]
    try:                                           # (its stats lines say which SUN workers its router sees)
        ps.start("hub", BIN / "edge-hub", "serve", "--mosquitto", "--acl", "--port", port,
                 "--draft-model", model, "--sun-decoder", dec_dir, "--stats-every", "0.25", *common, *signed,
                 *[x for u in users for x in ("--user", u)])
        ps.wait_for("hub", "serving on")
        agent = [BIN / "edge-agent", "run", "--broker", url]
        ps.start("target", *agent, "--role", "target", "--model", model, "--username", "dev1",
                 "--password", PW, "--prompt", PROMPT, "-n", MAX_NEW, "-g", "3", *common)
        ps.start("prefill", *agent, "--role", "prefill", "--module", maths_dir, "--task", "maths",
                 "--username", "prefill-maths", "--password", PW, "--threads", "1", *signed)
        ps.start("decoder", *agent, "--role", "decoder", "--module", dec_dir,
                 "--username", "dec-agent", "--password", PW, "--max-batch", "8", "--threads", "1", *signed)
        yield ps, url, model, dec_dir, maths_dir
    finally:
        ps.close()


def test_starsd_target_process_through_the_hub_process(star):
    from edge.engines.loader import open_model
    ps, url, model, _, _ = star
    ref, text = greedy_text(*open_model(str(model), dtype="float64", threads=1, max_len=4096), PROMPT, MAX_NEW)
    assert len(ref) >= 8, "the reference should be long enough to need several draft rounds"
    assert ps.procs["target"].wait(60) == 0, ps.err("target")
    assert ps.out("target") == text
    err = ps.err("target")
    assert "joined the star" in err and f"{len(ref)} tokens" in err, err
    answered = int(err.split("answered ")[1].split("/")[0])
    assert answered > 0, f"the hub's draft service never answered:\n{err}"


def test_sun_request_through_agent_prefill_and_both_decoders(star):
    ps, url, _, dec_dir, maths_dir = star
    prompts = [[5, 17, 99, 3, 42, 7], [200, 11, 64, 8]]
    refs = [_sun_reference(maths_dir, dec_dir, p, n) for p, n in zip(prompts, (150, 12))]
    ps.wait_for("prefill", "up at")
    ps.wait_for("decoder", "up at")
    # both decoders known to the hub's router: their retained hellos, as an operator's monitor sees them
    from edge.wire.protocol import SUN_WORKERS_SUB, decode
    hellos = {}
    mon = MqttLink(url, username="monitor", password=PW).connect(10)
    mon.subscribe(SUN_WORKERS_SUB,
                  lambda t, p: p and hellos.__setitem__(t.rsplit("/", 1)[1], decode(p, ps.ctl_key)))
    client = SunClient(MqttLink(url, username="app", password=PW).connect(10), "app").start()
    try:
        workers = ("hub-decoder", "dec-agent", "prefill-maths")
        assert wait_until(lambda: all(hellos.get(w) and hellos[w].online for w in workers), 30), \
            f"workers seen: {hellos}\n{ps.err('hub')}"
        # ... and by the hub's router itself: its stats line counts the workers it would route to
        ps.wait_for("hub", f"sun_workers={len(workers)}", 30)
        # a long request holds one decoder, so the next one goes to the other (least loaded)
        handles = [client.submit("maths", p, max_new=n) for p, n in zip(prompts, (150, 12))]
        results = [h.wait(30) for h in handles]
        for r, ref in zip(results, refs):
            assert r.tokens == ref and r.workers[0] == "prefill-maths"
        assert {r.workers[1] for r in results} == {"hub-decoder", "dec-agent"}
        with pytest.raises(SunRequestError, match="no prefill worker serves task 'poetry'"):
            client.generate("poetry", prompts[0], max_new=4, timeout=20)
    finally:
        client.close()
        client.link.close()
        mon.close()
    for name in ("prefill", "decoder", "hub"):     # each leaves cleanly on SIGTERM
        assert ps.stop(name) == 0, ps.err(name)


def test_cli_usage_errors():
    from click.testing import CliRunner

    from edge.cli.agent_run import run
    from server.hub_cli import main
    r = CliRunner().invoke(main, ["serve", "--sun-pool", "maths=dec-a"])
    assert r.exit_code == 2 and "--sun-isolated" in r.output
    r = CliRunner().invoke(main, ["serve", "--sun-isolated", "--sun-pool", "maths"])
    assert r.exit_code == 2 and "TASK=DECODER" in r.output
    r = CliRunner().invoke(main, ["serve", "--sun-http-port", "8080"])
    assert r.exit_code == 2 and "--sun-tokenizer" in r.output
    short = Path(__file__).parent / "__short.key"
    try:
        short.write_bytes(b"abc")
        r = CliRunner().invoke(main, ["serve", "--ctl-key-file", str(short)])
        assert r.exit_code == 2 and "at least 16" in r.output
    finally:
        short.unlink(missing_ok=True)
    r = CliRunner().invoke(run, ["--role", "decoder", "--broker", "mqtt://127.0.0.1:1"])
    assert r.exit_code == 2 and "--module" in r.output
    r = CliRunner().invoke(run, ["--role", "target", "--broker", "mqtt://127.0.0.1:1"])
    assert r.exit_code == 2 and "--model" in r.output
    r = CliRunner().invoke(run, ["--role", "target", "--broker", "mqtt://127.0.0.1:1", "--gamma", "often"])
    assert r.exit_code == 2 and "`auto`" in r.output
