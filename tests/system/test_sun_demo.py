"""The SUN part of `make demo` (`edge-hub demo-sun`), end to end on the synthetic specialists.

It reuses the session's synthetic accuracy table (conftest.sun_table) as its
cache, so nothing trains twice: the demo must find the specialists, serve
every request through the hub's router over a real MQTT broker, batch the
tasks together on its one int4 decoder and hand back exactly what the same
modules give in-process.
"""
import io
import shutil

from edge.model.sun_modules import save_module
from server.demos.sun_demo import run_sun_demo


def test_sun_demo_serves_every_task_on_one_decoder(sun_table, tmp_path):
    res, table_dir, base = sun_table
    work = tmp_path / "demo-sun"
    shutil.copytree(table_dir, work)
    save_module(work / "base", base, {"kind": "synthetic-base"})
    out = io.StringIO()
    report = run_sun_demo(work, n_requests=24, rate=200.0, zipf=1.0, seed=3, live=False, out=out)
    text = out.getvalue()
    assert report["errors"] == [], text
    assert report["served"] == 24 and report["identical_to_in_process"] == 24, text
    assert "tuning the specialists" not in text          # the cache was used: nothing retrained
    assert "| QSUN" in text or "QSUN" in text            # the table is shown
    dec = report["decoder"]
    assert dec["refused"] == 0 and dec["batch_mean"] > 1.0 and dec["mixed_frac"] > 0.0, dec
    # the served answers score what the table says QSUN scores (same modules, same prompts)
    for task, acc in report["accuracy"].items():
        if acc is not None:
            assert abs(acc - res["cells"][task]["qsun"]["acc"]) <= 0.35, (task, acc)
