"""Prometheus text on /metrics (prometheus_client): the starsun_* metrics of Telemetry messages.

An agent exports its own report; the hub exports its own and every device's it has heard on
ss/dev/+/telemetry (server/telemetry_board.py), one series per client, labelled
client and role. The values are the last report's (a scrape never measures by itself
unless the role publishes no telemetry, when each scrape takes a fresh report).
"""
from __future__ import annotations

import time
from typing import Callable, Dict, Iterable, Optional

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from edge.wire.protocol import Telemetry

MB = 1e6
# (metric, help, Telemetry field, scale); fields that are None are left out of the scrape
GAUGES = [
    ("starsun_rss_bytes", "resident memory of the process", "rss_mb", MB),
    ("starsun_memory_available_bytes", "memory available on the machine", "mem_avail_mb", MB),
    ("starsun_memory_total_bytes", "memory of the machine", "mem_total_mb", MB),
    ("starsun_kv_used_bytes", "KV cache in use", "kv_used_mb", MB),
    ("starsun_kv_budget_bytes", "KV cache budget", "kv_budget_mb", MB),
    ("starsun_cpu_percent", "CPU load of the machine", "cpu_pct", 1.0),
    ("starsun_gpu_percent", "GPU load", "gpu_pct", 1.0),
    ("starsun_temperature_celsius", "hottest temperature sensor", "temp_c", 1.0),
    ("starsun_power_watts", "power drawn by the board", "power_w", 1.0),
    ("starsun_tokens_per_second", "tokens produced per second over the last interval", "tok_s", 1.0),
    ("starsun_tokens_per_joule", "tokens per joule (where power is known)", "tok_j", 1.0),
    ("starsun_sessions", "sessions or requests held", "sessions", 1.0),
    ("starsun_acceptance_ratio", "drafted tokens accepted by the target", "acceptance", 1.0),
    ("starsun_busy_ratio", "share of time the role computed over the last interval", "busy", 1.0),
    ("starsun_batch_size_mean", "mean batch size", "batch_mean", 1.0),
    ("starsun_batch_size_max", "largest batch size", "batch_max", 1.0),
]
COUNTERS = [
    ("starsun_tokens", "tokens produced since start", "tokens"),
    ("starsun_dropped", "messages the role dropped", "dropped"),
]


class TelemetryCollector:
    """A prometheus_client collector over the Telemetry messages `messages()` returns."""

    def __init__(self, messages: Callable[[], Iterable[Telemetry]],
                 dropped: Optional[Callable[[], Dict[str, int]]] = None):
        self.messages, self.dropped = messages, dropped

    def collect(self):
        msgs = [m for m in self.messages() if m is not None]
        labels = ["client", "role"]
        for name, doc, attr, scale in GAUGES:
            g = GaugeMetricFamily(name, doc, labels=labels)
            for m in msgs:
                v = getattr(m, attr)
                if v is not None:
                    g.add_metric([m.client, m.role], float(v) * scale)
            yield g
        for name, doc, attr in COUNTERS:
            c = CounterMetricFamily(name, doc, labels=labels)
            for m in msgs:
                c.add_metric([m.client, m.role], float(getattr(m, attr)))
            yield c
        age = GaugeMetricFamily("starsun_telemetry_age_seconds", "seconds since the report was made",
                                labels=labels)
        now = time.time()
        for m in msgs:
            age.add_metric([m.client, m.role], max(0.0, now - m.time))
        yield age
        if self.dropped is not None:
            d = CounterMetricFamily("starsun_telemetry_dropped", "telemetry messages dropped, by reason",
                                    labels=["reason"])
            for reason, n in sorted(self.dropped().items()):
                d.add_metric([reason], float(n))
            yield d


class MetricsServer:
    """/metrics over HTTP on host:port (127.0.0.1 unless told otherwise); `port` is the bound one."""

    def __init__(self, host: str, port: int, collectors):
        self.host, self.port = host, port
        self.registry = CollectorRegistry()
        for c in collectors:
            self.registry.register(c)
        self._server = None

    def start(self) -> "MetricsServer":
        self._server, _thread = start_http_server(self.port, addr=self.host, registry=self.registry)
        self.port = self._server.server_port
        return self

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}/metrics"

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
