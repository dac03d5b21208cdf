"""harness/hub_stats.py reads the stats line `edge-hub serve` writes (server/hub_serve.py): the
networks tests wait on it, so its format and the reader must agree."""
from __future__ import annotations

from harness.hub_stats import sun_workers
from server.hub_serve import stats_line


class _Hub:
    def __init__(self, workers: dict):
        self.workers = workers

    def snapshot(self) -> dict:
        return {"registry": {"sessions": 0}, "counters": {"joins": 0, "refused": 0},
                "sun": {"workers": self.workers, "counters": {"requests": 0, "routed": 0}}}


def test_the_last_stats_line_counts_the_workers_the_router_routes_to():
    up, down = {"online": True}, {"online": False}
    log = "\n".join([stats_line(_Hub({"pre": up, "dec": down})), "a log line", stats_line(_Hub({"pre": up, "dec": up}))])
    assert sun_workers(log) == 2
    assert sun_workers(log + "\n" + stats_line(_Hub({"pre": up, "dec": down}))) == 1


def test_no_stats_line_about_workers_yet():
    assert sun_workers(stats_line(_Hub({}))) is None       # a router that heard of no worker says nothing
    assert sun_workers("") is None
