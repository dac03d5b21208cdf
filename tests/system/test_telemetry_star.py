"""Telemetry end to end: `edge-hub serve` and `edge-agent run --role draft` as real processes on
a real Mosquitto with the hub's ACL, a target in this process driving tokens through them.

Both publish retained reports on ss/dev/{client}/telemetry and serve /metrics; `edge-hub top
--once` shows both rows; a malformed report (or one claiming another client) is dropped
and counted, and the hub goes on; a device that stops cleanly leaves the table.
"""
from __future__ import annotations

import os
import signal
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from edge.wire.link import MqttLink
from edge.wire.protocol import Telemetry, encode, telemetry_topic

from harness.canary import canary_after
from harness.console_scripts import hf_model
from harness.tiny_models import small_bpe
from harness.waiting import wait_until

ROOT = Path(__file__).resolve().parents[2]
BIN = ROOT / ".venv" / "bin"
PW = "pw-for-telemetry"
INTERVAL = "0.3"


class Procs:
    def __init__(self, root: Path):
        self.root, self.procs = root, {}
        self.env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONIOENCODING="utf-8")

    def start(self, name, *args):
        out, err = open(self.root / f"{name}.out", "wb"), open(self.root / f"{name}.err", "wb")
        self.procs[name] = subprocess.Popen([str(a) for a in args], cwd=ROOT, env=self.env, stdout=out, stderr=err)
        out.close()
        err.close()

    def err(self, name):
        return (self.root / f"{name}.err").read_text(errors="replace")

    def wait_for(self, name, text, timeout=60.0):
        p = self.procs[name]
        if not wait_until(lambda: text in self.err(name) or p.poll() is not None, timeout):
            raise AssertionError(f"{name} did not say {text!r}:\n{self.err(name)}")
        assert text in self.err(name), f"{name} exited {p.returncode}:\n{self.err(name)}"

    def close(self):
        for p in self.procs.values():
            if p.poll() is None:
                p.kill()
                p.wait()


@pytest.fixture(scope="module")
def star(tmp_path_factory):
    from server.broker_base import find_free_port
    root = tmp_path_factory.mktemp("telemetry")
    model = hf_model(root / "tiny-hf", seed=3, vocab_size=300, save_tokenizer=lambda d: small_bpe().save(d))
    pw = root / "pw"
    pw.write_text(PW)
    port, hub_metrics, draft_metrics = find_free_port(), find_free_port(), find_free_port()
    url = f"mqtt://127.0.0.1:{port}"
    ps = Procs(root)
    users = [f"{n}:{r}:{PW}" for n, r in (("drafter", "draft"), ("monitor", "hub"), ("dev1", "client"),
                                           ("intruder", "client"))]
    try:
        ps.start("hub", BIN / "edge-hub", "serve", "--mosquitto", "--acl", "--port", port, "--stats-every", "0",
                 "--telemetry-interval", INTERVAL, "--metrics-port", hub_metrics,
                 *[x for u in users for x in ("--user", u)])
        ps.wait_for("hub", "serving on")
        ps.start("draft", BIN / "edge-agent", "run", "--role", "draft", "--broker", url, "--model", model,
                 "--username", "drafter", "--password-file", pw, "--threads", "1", "--dtype", "float64",
                 "--max-len", "256", "--telemetry-interval", INTERVAL, "--metrics-port", draft_metrics,
                 "--draft-p-min", "0")          # a tiny random draft is never sure: draft every γ
        ps.wait_for("draft", "registered")
        yield ps, url, model, pw, f"http://127.0.0.1:{hub_metrics}/metrics", f"http://127.0.0.1:{draft_metrics}/metrics"
    finally:
        ps.close()


def _scrape(url: str) -> dict:
    """{(metric sample name, client): value} from a real HTTP scrape, parsed by prometheus_client."""
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, s.labels.get("client", s.labels.get("reason")))] = s.value
    return out


def _top(url: str, pw: Path) -> str:
    r = subprocess.run([str(BIN / "edge-hub"), "top", "--broker", url, "--username", "monitor", "--password-file",
                        str(pw), "--once", "--wait", "5"], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    return r.stdout


def _rows(table: str) -> dict:
    return {ln.split()[0]: ln.split() for ln in table.splitlines()[1:] if ln and not ln.startswith(("dropped", "("))}


def _until(check, timeout=30.0):
    """check()'s first truthy value within timeout, else its last value."""
    got = {}

    def ready():
        got["value"] = check()
        return bool(got["value"])
    wait_until(ready, timeout)
    return got["value"]


def test_draft_node_and_hub_report_through_mqtt_metrics_and_top(star):
    from edge.engines.loader import open_model
    from edge.star.hub_client import HubClient
    from edge.star.target import StarTarget
    ps, url, model, pw, hub_url, draft_url = star
    engine, tok = open_model(str(model), dtype="float64", threads=1, max_len=256)
    link = MqttLink(url, username="dev1", password=PW).connect(10)
    target = StarTarget(engine, HubClient(link, "dev1", tok.fingerprint(), engine.vocab_size), gamma=3)
    try:
        out = target.generate(tok.encode("the quick brown fox"), 16)
        assert target.last_drafter.stats.answered > 0, "the device's draft service never answered"
        t = target.telemetry()
        assert t["tokens"] == len(out.tokens) and t["drafted"] == out.n_drafted and t["generations"] == 1
    finally:
        target.hub.close()
        link.close()
    ps.wait_for("draft", "metrics on")
    m = _until(lambda: (lambda s: s if s.get(("starsun_tokens_total", "drafter"), 0) > 0 else None)(_scrape(draft_url)))
    assert m, "the draft's /metrics never counted a drafted token"
    assert m[("starsun_rss_bytes", "drafter")] > 20e6              # a process with torch and a model loaded
    assert 0 < m[("starsun_memory_available_bytes", "drafter")] <= m[("starsun_memory_total_bytes", "drafter")]
    assert m[("starsun_kv_budget_bytes", "drafter")] == 1024e6     # --max-kv-mb's default
    assert m[("starsun_kv_used_bytes", "drafter")] >= 0
    assert 0 <= m[("starsun_cpu_percent", "drafter")] <= 100
    assert 0 <= m[("starsun_busy_ratio", "drafter")] <= 1
    assert m[("starsun_batch_size_max", "drafter")] >= 1
    hub = _scrape(hub_url)                                         # the hub's: itself and every device
    assert hub[("starsun_rss_bytes", "hub")] > 20e6 and hub[("starsun_rss_bytes", "drafter")] > 20e6
    rows = _rows(_top(url, pw))
    assert set(rows) == {"hub", "drafter"}, rows
    assert rows["hub"][1] == "hub" and rows["drafter"][1] == "draft"
    assert float(rows["drafter"][2]) > 20 and rows["drafter"][3].endswith("/1024")   # RSS MB, KV used/budget


def _dropped(hub_url: str, reason: str, n: int):
    """The hub's drop counters once it counted n drops for `reason` (None if it never did)."""
    return _until(lambda: (lambda s: s if s.get(("starsun_telemetry_dropped_total", reason), 0) >= n else None)(
        _scrape(hub_url)))


def test_malformed_and_forged_reports_are_dropped_and_counted(star, inbox):
    ps, url, _, pw, hub_url, _ = star
    spy = MqttLink(url, username="intruder", password=PW).connect(10)
    mon = MqttLink(url, username="monitor", password=PW).connect(10)      # role hub: reads every report
    try:
        spy.publish(telemetry_topic("intruder"), b"\x93not msgpack at all", kind="status")   # its own topic: allowed
        assert _dropped(hub_url, "format", 1), "the hub never counted the malformed report"
        claim = Telemetry(client="drafter", role="draft", time=time.time(), rss_mb=1.0)   # someone else's name
        spy.publish(telemetry_topic("intruder"), encode(claim), kind="status")
        drops = _dropped(hub_url, "wrong_client", 1)
        assert drops and drops[("starsun_telemetry_dropped_total", "format")] == 1, drops
        assert drops[("starsun_telemetry_dropped_total", "wrong_client")] == 1
        assert ps.procs["hub"].poll() is None
        table = _top(url, pw)                                      # top reads the retained forgery: dropped too
        assert set(_rows(table)) == {"hub", "drafter"} and "dropped reports: wrong_client 1" in table, table
        # another client's topic: the broker's ACL refuses it (Mosquitto drops the intruder's connection)
        drafter_reports = inbox()
        assert mon.subscribe(telemetry_topic("drafter"), drafter_reports)
        forged = encode(Telemetry(client="drafter", role="target", time=time.time()))
        spy.publish(telemetry_topic("drafter"), forged, kind="status")
        # a canary the intruder sends after it reaches the monitor (harness/canary.py): the forgery
        # would have been delivered before it, and stored as the retained report before it
        canary_after(mon, [spy], [mon], inbox)
        assert forged not in drafter_reports.payloads()
        assert _rows(_top(url, pw))["drafter"][1] == "draft"
    finally:
        spy.close()
        mon.close()


def test_a_device_that_stops_cleanly_leaves_the_table(star):
    ps, url, _, pw, _, _ = star
    p = ps.procs["draft"]
    p.send_signal(signal.SIGTERM)
    assert p.wait(30) == 0, ps.err("draft")
    assert set(_rows(_top(url, pw))) == {"hub"}
