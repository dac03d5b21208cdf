"""The reverse star's console scripts as real processes (#46): `edge-hub serve --verify-model`
(Mosquitto with the ACL) and `edge-agent run --role drafter`: the drafter's text is the hub
target's own plain greedy text (tiny float64 model; the drafter drafts with the same model here,
so every draft is accepted and the rounds are few)."""
from __future__ import annotations

import pytest

from harness.console_scripts import BIN, MAX_NEW, PROMPT, PW, Procs
from harness.console_scripts import hf_model as _hf_model


@pytest.fixture(scope="module")
def star(tmp_path_factory):
    from server.broker import find_free_port
    root = tmp_path_factory.mktemp("reverse-cli")
    model = _hf_model(root / "tiny-hf")
    port = find_free_port()
    ps = Procs(root)
    common = ["--threads", "1", "--dtype", "float64"]
    try:
        ps.start("hub", BIN / "edge-hub", "serve", "--mosquitto", "--acl", "--port", port,
                 "--verify-model", model, "--stats-every", "0.25", *common, "--user", f"pi:client:{PW}")
        ps.wait_for("hub", "serving on")
        ps.start("drafter", BIN / "edge-agent", "run", "--broker", f"mqtt://127.0.0.1:{port}", "--role", "drafter",
                 "--model", model, "--username", "pi", "--password", PW, "--prompt", PROMPT, "-n", MAX_NEW,
                 "-g", "3", *common)
        yield ps, model
    finally:
        ps.close()


def test_drafter_process_serves_the_hub_targets_text(star):
    from edge.engines.loader import open_model
    from edge.speculative.generate import generate_plain
    ps, model = star
    engine, tok = open_model(str(model), dtype="float64", threads=1, max_len=4096)
    ids = tok.encode(PROMPT, add_special=True)
    ref = generate_plain(engine, ids, MAX_NEW, stop_ids=tuple(tok.eos_ids)).tokens
    stream = tok.decode_stream(skip_special=True)
    assert ps.procs["drafter"].wait(60) == 0, ps.err("drafter")
    assert ps.out("drafter") == "".join(stream.put(t) for t in ref)
    err = ps.err("drafter")
    assert "joined the hub's verify service" in err and f"{len(ref)} tokens" in err, err
    rounds = int(err.split(" round trips")[0].rsplit(" ", 1)[1])
    assert 0 < rounds < len(ref), err                   # drafted: fewer round trips than tokens
