"""The router's task routing with adapter workers (server/sun_router.py): a task goes to any online
prefill worker whose hello lists it, the least loaded (ties by id); a hello with a new task list
(an adapter added) is routed from at once; a task no worker lists is refused naming what exists."""
import pytest

from edge.wire.protocol import E_UNKNOWN_TASK, SunHello
from server.sun_router import SunRefusal, SunRouter


class Link:
    """What the router uses of a link, recording what it publishes."""

    def __init__(self):
        self.sent = []

    def publish(self, topic, payload, kind="control"):
        self.sent.append(topic)
        return True

    def subscribe(self, *a):
        return True

    def on_connection(self, cb):
        pass


def hello(worker, tasks, role="prefill", served=0, load=0):
    return SunHello(worker, role, tasks[0] if tasks else "", "fp", 256, True, load, 8, served, 0, tasks=list(tasks))


def router():
    r = SunRouter(Link())
    for h in (hello("w1", ["code", "maths"]), hello("w2", ["maths", "tools"]), hello("dec", [], role="decoder")):
        r.update_worker(h)
        r.update_worker(h)                 # the answer to its probe: alive
    return r


def test_a_task_goes_to_a_worker_listing_it_least_loaded_first():
    r = router()
    assert r.tasks() == ["code", "maths", "tools"]
    assert r.route("code")[0].id == "w1" and r.route("tools")[0].id == "w2"
    assert [r.route("maths")[0].id for _ in range(4)] == ["w1", "w2", "w1", "w2"]
    assert r.snapshot()["workers"]["w2"]["tasks"] == ["maths", "tools"]


def test_a_new_task_list_is_routed_from_at_once_and_unknown_tasks_are_refused():
    r = router()
    with pytest.raises(SunRefusal) as e:
        r.route("poetry")
    assert e.value.code == E_UNKNOWN_TASK and "tasks here: code, maths, tools" in e.value.reason
    r.update_worker(hello("w2", ["maths", "poetry", "tools"]))         # an adapter added while serving
    assert r.route("poetry")[0].id == "w2" and r.tasks() == ["code", "maths", "poetry", "tools"]
    r.update_worker(hello("w1", ["code"], served=0))
    assert {r.route("maths")[0].id for _ in range(3)} == {"w2"}
