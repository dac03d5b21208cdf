"""Publish a role's Telemetry, retained, on ss/dev/{client}/telemetry every `interval` seconds,
and serve it as Prometheus text on /metrics (edge/telemetry/metrics_http.py).

Retained, so `edge-hub top` and the hub see every device at once on subscribing; a clean stop
clears the retained message (an empty payload), so a device that left is not shown; one that
died keeps its last report, whose age says so. Signed with the deployment's control key when
there is one, like every other control message.
"""
from __future__ import annotations

import logging
import threading
from typing import Callable, Optional

from edge.wire.link import Link
from edge.wire.protocol import Telemetry, encode, telemetry_topic
from edge.telemetry.readings import SystemSampler, TelemetryReporter

log = logging.getLogger(__name__)


class TelemetryPublisher:
    def __init__(self, link: Optional[Link], reporter: TelemetryReporter, interval: float,
                 ctl_key: Optional[bytes] = None):
        if interval < 0:
            raise ValueError(f"the telemetry interval must be >= 0 seconds (0: off), got {interval}")
        self.link, self.reporter, self.interval, self.ctl_key = link, reporter, interval, ctl_key
        self.topic = telemetry_topic(reporter.client)
        self.last: Optional[Telemetry] = None
        self.sent = 0
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def publish_once(self) -> Telemetry:
        msg = self.reporter.report()
        self.last = msg
        if self.link is not None and self.link.publish(self.topic, encode(msg, self.ctl_key), kind="status"):
            self.sent += 1
        return msg

    def latest(self) -> Telemetry:
        """The last report (a fresh one when not publishing periodically): what /metrics shows."""
        if self._thread is None or self.last is None:
            return self.reporter.report()
        return self.last

    def start(self) -> "TelemetryPublisher":
        if self.interval > 0 and self.link is not None:
            self._thread = threading.Thread(target=self._loop, name=f"telemetry-{self.reporter.client}",
                                            daemon=True)
            self._thread.start()
        return self

    def _loop(self) -> None:
        while True:
            try:
                self.publish_once()
            except Exception:  # a failed reading must not end the reports
                log.exception("telemetry of %s failed", self.reporter.client)
            if self._stop.wait(self.interval):
                return

    def stop(self, clear: bool = True) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)
            if clear and self.link is not None:
                self.link.publish(self.topic, b"", kind="status")    # empty retained: the device left
        self.reporter.sampler.close()


class TelemetryService:
    """The publisher and, with a metrics port, the /metrics endpoint of one role (or the hub)."""

    def __init__(self, publisher: TelemetryPublisher, metrics=None):
        self.publisher, self.metrics = publisher, metrics

    def stop(self) -> None:
        if self.metrics is not None:
            self.metrics.stop()
        self.publisher.stop()


def start_telemetry(link: Optional[Link], client: str, role: str, counters: Callable[[], dict],
                    interval: float = 0.0, metrics_host: str = "127.0.0.1", metrics_port: int = 0,
                    ctl_key: Optional[bytes] = None, gpu: str = "auto", board=None) -> Optional[TelemetryService]:
    """Start what `--telemetry-interval` and `--metrics-port` ask for; None when both are off.
    `board` (the hub's server.telemetry_board.TelemetryBoard): /metrics also shows every device it
    heard, and its dropped reports. Raises OSError when the metrics port cannot be bound."""
    if interval <= 0 and not metrics_port:
        return None
    reporter = TelemetryReporter(client, role, counters, SystemSampler(gpu), interval=interval)
    pub = TelemetryPublisher(link, reporter, interval, ctl_key).start()
    metrics = None
    if metrics_port:
        from edge.telemetry.metrics_http import MetricsServer, TelemetryCollector
        def reports():
            others = [m for m in board.messages() if m.client != client] if board is not None else []
            return [pub.latest(), *others]
        try:
            metrics = MetricsServer(metrics_host, metrics_port, [TelemetryCollector(
                reports, dropped=(lambda: board.dropped) if board is not None else None)]).start()
        except OSError:
            pub.stop()
            raise
    return TelemetryService(pub, metrics)
