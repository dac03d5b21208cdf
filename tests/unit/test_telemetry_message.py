"""The Telemetry message (round trip, size, limits, signing), its topic and ACL rule, the
reporter's rates, and `edge-hub top`'s table."""
from __future__ import annotations

import time
from pathlib import Path

import pytest

from edge.wire import protocol as P
from edge.telemetry.tegrastats import parse_line
from edge.telemetry.readings import SystemSampler, TelemetryReporter
from server.acl import Acl
from server.top import render

KEY = b"k" * 32
NANO_LOADED = [ln.split("|", 1)[1] for ln in
               (Path(__file__).resolve().parents[1] / "fixtures" / "tegrastats_orin.txt").read_text().splitlines()
               if ln.startswith("orin-nano|")][1]


def full(**kw) -> P.Telemetry:
    base = dict(client="jetson-1", role="draft", time=1.8e9, interval=5.0, rss_mb=812.5, mem_avail_mb=3012.0,
                mem_total_mb=7620.0, kv_used_mb=12.5, kv_budget_mb=1024.0, cpu_pct=37.5, gpu_pct=63.0,
                temp_c=53.968, power_w=12.479, tokens=123456, tok_s=41.5, tok_j=3.3, sessions=4,
                acceptance=0.71, busy=0.83, batch_mean=3.4, batch_max=8, dropped=2, source="psutil+tegrastats")
    base.update(kw)
    return P.Telemetry(**base)


def test_round_trip_and_size():
    msg = full()
    data = P.encode(msg)
    assert P.decode(data) == msg
    assert len(data) < 512, f"telemetry is retained per device: keep it small ({len(data)} bytes)"


def test_missing_readings_travel_as_none():
    msg = full(kv_used_mb=None, kv_budget_mb=None, gpu_pct=None, temp_c=None, power_w=None, tok_j=None,
               acceptance=None, busy=None, batch_mean=None)
    assert P.decode(P.encode(msg)) == msg


@pytest.mark.parametrize("bad", [dict(cpu_pct=150.0), dict(busy=1.5), dict(role="toaster"), dict(client="a/b"),
                                 dict(tok_s=float("nan")), dict(acceptance=-0.1), dict(tokens=-1)])
def test_out_of_range_fields_are_refused(bad):
    with pytest.raises(P.ProtocolError):
        P.encode(full(**bad))


def test_signed_with_the_ctl_key_like_other_control_messages():
    data = P.encode(full(), KEY)
    assert P.decode(data, KEY).client == "jetson-1"
    with pytest.raises(P.ProtocolError) as e:
        P.decode(data, b"x" * 32)
    assert e.value.code == "auth"


def test_topic_and_acl():
    assert P.telemetry_topic("jetson-1") == "ss/dev/jetson-1/telemetry"
    assert P.parse_topic("ss/dev/jetson-1/telemetry") == ("telemetry", {"client": "jetson-1"})
    assert P.TELEMETRY_SUB == "ss/dev/+/telemetry"
    acl = Acl()
    for name, role in (("jetson-1", "client"), ("drafter", "draft"), ("worker", "sun"), ("monitor", "hub")):
        acl.add(name, role)
    for name in ("jetson-1", "drafter", "worker"):
        assert acl.allows(name, P.telemetry_topic(name), "write")
        assert not acl.allows(name, P.telemetry_topic("someone-else"), "write")
        assert not acl.allows(name, P.TELEMETRY_SUB, "subscribe")       # devices do not read each other
    assert acl.allows("monitor", P.TELEMETRY_SUB, "subscribe")
    assert "pattern write ss/dev/%u/telemetry" in acl.mosquitto_acl()


class _Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


class _RecordedJetson:
    """A Jetson reading from a recorded tegrastats line (no Jetson here)."""

    def latest(self):
        return parse_line(NANO_LOADED)

    def close(self):
        pass


def test_reporter_rates_acceptance_and_tokens_per_joule():
    counters = {"tokens": 0, "busy_s": 0.0, "wall_s": 0.0, "accepted": 0, "drafted": 0, "sessions": 2,
                "kv_used_bytes": 5e6, "kv_budget_bytes": 1e9, "dropped": {"auth": 2, "replay": 1}}
    clock = _Clock()
    rep = TelemetryReporter("jetson-1", "target", lambda: dict(counters), SystemSampler(jetson=_RecordedJetson()),
                            interval=2.0, clock=clock)
    first = rep.report()
    assert first.tok_s == 0.0 and first.acceptance is None
    clock.t += 2.0
    counters.update(tokens=100, busy_s=1.5, wall_s=2.0, accepted=30, drafted=40)
    msg = rep.report()
    assert msg.tok_s == pytest.approx(50.0) and msg.tokens == 100
    assert msg.busy == pytest.approx(0.75) and msg.acceptance == pytest.approx(0.75)
    assert msg.power_w == pytest.approx(12.479) and msg.gpu_pct == 63.0 and msg.temp_c == pytest.approx(53.968)
    assert msg.tok_j == pytest.approx(50.0 / 12.479)
    assert (msg.kv_used_mb, msg.kv_budget_mb, msg.sessions, msg.dropped) == (5.0, 1000.0, 2, 3)
    assert msg.rss_mb > 1 and 0 < msg.mem_avail_mb <= msg.mem_total_mb
    assert msg.source == "psutil+tegrastats"
    P.encode(msg)                                                      # every report is a valid message


def test_without_power_there_are_no_tokens_per_joule():
    rep = TelemetryReporter("pc", "draft", lambda: {"tokens": 10}, SystemSampler(gpu="none"))
    assert rep.report().power_w is None and rep.report().tok_j is None


def test_top_table_shows_each_device_and_marks_stale_ones():
    now = time.time()
    rows = [(full(client="hub", role="hub", time=now - 1, kv_used_mb=None, kv_budget_mb=None), 1.0),
            (full(time=now - 60), 60.0)]
    text = render(rows, {"format": 1})
    lines = text.splitlines()
    assert lines[0].split()[:3] == ["client", "role", "RSS"]
    hub = lines[1].split()
    dev = lines[2].split()
    assert hub[:3] == ["hub", "hub", "812"] and hub[3] == "-"          # no KV: not a draft
    assert dev[:4] == ["jetson-1", "draft", "812", "12/1024"] and dev[-1] == "stale"   # 60 s > 3 x 5 s
    assert "12.5" in dev and "41.5" in dev and "0.71" in dev
    assert lines[-1] == "dropped reports: format 1"
    assert "no device has reported" in render([])
