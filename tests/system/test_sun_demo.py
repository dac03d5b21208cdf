"""The SUN part of `make demo` (`edge-hub demo-sun`), end to end on the synthetic specialists.

Its specialists are prefill-only LoRA adapters over one tiny base: the demo must serve every
request through the hub's router over a real MQTT broker from ONE prefill worker holding the base
once and every task's adapter, batch the tasks together on its one int4 decoder, and hand back
exactly what the same base + adapter and decoder give in-process. It runs twice on one --work:
the first run trains the base and tunes the adapters, the second finds them cached and trains
nothing. The training runs at a test's budget (`small_specialists`): what is checked here is the
serving, and the adapters only need to score what the table says they score.
"""
import io
import json
from dataclasses import replace

import pytest

from edge.model.lora.files import WEIGHTS_FILE
from server.demos.sun_demo import DECODER_ID, PREFILL_ID, run_sun_demo
from server.demos.sun_specialists import SERVED

TASKS = ["reverse", "rotate", "sort"]


# base 600 steps (of 800), SUN-LoRA 500 (of 1000), QSUN-LoRA 30 (of 100), 64 held-out prompts a
# task (of 200): the served QSUN-LoRA adapters scored 0.91 / 0.97 / 0.78 on reverse / rotate / sort
BASE_STEPS, SUN_STEPS, QSUN_STEPS, N_EVAL = 600, 500, 30, 64


@pytest.fixture
def small_specialists(monkeypatch):
    """The demo's base and adapters trained for a fraction of `make demo`'s steps, scored on
    fewer held-out prompts (the demo's own budget cost ~2 min of one core here)."""
    import export.sun_eval as sun_eval
    import server.demos.sun_specialists as specialists
    monkeypatch.setattr(specialists, "SUN_LORA", replace(specialists.SUN_LORA, steps=SUN_STEPS))
    monkeypatch.setattr(specialists, "QSUN_LORA", replace(specialists.QSUN_LORA, steps=QSUN_STEPS))
    from harness.synthetic_base import synthetic_base as kept   # conftest's sun_table trains the same base
    suite = sun_eval.synthetic_suite
    monkeypatch.setattr(sun_eval, "synthetic_base", lambda steps, **kw: kept(steps=BASE_STEPS, **kw))
    monkeypatch.setattr(sun_eval, "synthetic_suite", lambda n_train, n_eval, seed: suite(n_train, N_EVAL, seed))


def test_sun_demo_serves_adapters_from_one_prefill_worker_on_one_decoder(tmp_path, small_specialists):
    work = tmp_path / "demo-sun"
    out = io.StringIO()
    report = run_sun_demo(work, n_requests=24, rate=200.0, zipf=1.0, seed=3, live=False, out=out)
    text = out.getvalue()
    assert "tuning the specialists as rank-8 prefill-only adapters" in text and "| QSUN-LoRA" in text
    assert report["errors"] == [], text
    assert report["served"] == 24 and report["identical_to_in_process"] == 24, text
    # one prefill worker holds every task; every answer came from it and the one decoder
    assert {w: r for w, (r, _) in report["workers"].items()} == {PREFILL_ID: "prefill", DECODER_ID: "decoder"}
    assert report["workers"][PREFILL_ID][1] == TASKS, report["workers"]
    assert report["served_by"] == [(PREFILL_ID, DECODER_ID)]
    assert {t for step in report["prefill_steps"] for t in step} == set(TASKS)
    # the specialists are adapters: on disk and in the worker, the base once plus adapter-sized tensors
    mem = report["memory"]
    for t in TASKS:
        d = work / "specialists" / t / SERVED
        assert (d / WEIGHTS_FILE).is_file() and not (d / "model.safetensors").exists()
        m = mem["tasks"][t]
        assert 0 < 4 * m["adapter_bytes"] < m["full_copy_bytes"] == mem["base_bytes"], m
    assert mem["held"] == {"base_bytes": mem["base_bytes"],
                           "adapter_bytes": {t: mem["tasks"][t]["adapter_bytes"] for t in TASKS}}
    assert text.count("x less)") == 3 and "as full copies 3 x" in text      # a memory line per specialist
    dec = report["decoder"]
    assert dec["refused"] == 0 and dec["batch_mean"] > 1.0 and dec["mixed_frac"] > 0.0, dec
    # the served answers score what the table says the served adapters score (same prompts' task)
    table = json.loads((work / "results.json").read_text())["cells"]
    for task, acc in report["accuracy"].items():
        assert acc is not None and abs(acc - table[task][SERVED]["acc"]) <= 0.35, (task, acc, table)

    out = io.StringIO()
    again = run_sun_demo(work, n_requests=6, rate=200.0, zipf=1.0, seed=4, live=False, out=out)
    assert "tuning the specialists" not in out.getvalue() and "training" not in out.getvalue()
    assert again["errors"] == [] and again["served"] == again["identical_to_in_process"] == 6, out.getvalue()
