"""SUN routing policy over Mosquitto: isolated pools, the least-loaded decoder, a decoder lost
mid-request (its requests fail at once with worker_lost). The star: harness/sun_star.py."""
from __future__ import annotations

import pytest

from edge.sun.client import SunRequestError
from harness.sun_star import TASKS, Star, prompts, stuck_prefill, sun_models
from harness.waiting import wait_until


@pytest.fixture(scope="module")
def models():
    return sun_models()


def test_isolated_pools_give_each_task_its_own_decoder(mosquitto, models):
    star = Star(mosquitto.url, models, decoders=("dec-a", "dec-b", "dec-c"), isolated=True)
    try:
        star.add_prefill("extra", star.specs["code"])
        ps = prompts(6, seed=11)
        jobs = list(zip(TASKS * 2, ps))
        handles = [star.client.submit(t, p, max_new=6) for t, p in jobs]
        for h, (t, p) in zip(handles, jobs):
            assert h.wait(20).tokens == star.expect(t, p, 6)
        bound = star.router.bindings
        assert sorted(bound) == sorted(TASKS) and len(set(bound.values())) == 3
        for t, d in bound.items():
            node = star.decoders[d]
            assert node.tasks_served == {t} and all(set(b) <= {t} for b in node.batches)
            assert star.router.snapshot()["routed"][t] == {d: 2}
        with pytest.raises(SunRequestError, match="isolated pools: every decoder is bound") as e:
            star.client.generate("extra", ps[0], max_new=4, timeout=20)
        assert e.value.code == "no_decoder"
    finally:
        star.close()


def test_least_loaded_decoder_gets_the_work(mosquitto, models):
    star = Star(mosquitto.url, models, tasks=("maths",))
    stuck = star.link("prefill-stuck")               # announces a task, never answers: KV stays awaited
    try:
        stuck.connect(5)
        stuck_prefill(stuck, star.fp)
        assert wait_until(lambda: "prefill-stuck" in star.router.workers)
        for p in prompts(3, seed=2):
            star.client.submit("stuck", p, max_new=8)
        a = star.decoders["dec-a"]
        assert wait_until(lambda: a.load == 3 and star.router.workers["dec-a"].load == 3)
        star.add_decoder("dec-b")
        ps = prompts(2, seed=4)
        for p in ps:
            r = star.client.generate("maths", p, max_new=6, timeout=20)
            assert r.tokens == star.expect("maths", p, 6) and r.workers == ["prefill-maths", "dec-b"]
        assert star.router.snapshot()["routed"] == {"stuck": {"dec-a": 3}, "maths": {"dec-b": 2}}
    finally:
        star.close()


def test_decoder_lost_mid_request_fails_its_requests_at_once(mosquitto, models):
    """A decoder dies holding requests: their clients hear worker_lost from the router (not a
    timeout), requests it had finished get nothing, and the next request goes to a live decoder."""
    star = Star(mosquitto.url, models, tasks=("maths",))
    stuck = star.link("prefill-stuck")               # announces a task, never answers: KV stays awaited
    try:
        p = prompts(1, seed=5)[0]
        assert star.client.generate("maths", p, max_new=6, timeout=20).tokens == star.expect("maths", p, 6)
        assert wait_until(lambda: "dec-a" not in star.router.inflight)     # its idle hello cleared it
        stuck.connect(5)
        stuck_prefill(stuck, star.fp)
        assert wait_until(lambda: "prefill-stuck" in star.router.workers)
        star.client.retries = 0                       # no resend (test_process_faults covers it)
        handles = [star.client.submit("stuck", q, max_new=8) for q in prompts(3, seed=6)]
        a = star.decoders["dec-a"]
        assert wait_until(lambda: a.load == 3 and len(star.router.inflight.get("dec-a", {})) == 3)
        a.link.crash()                                # killed: the broker publishes its will
        for h in handles:                             # an error, not a TimeoutError after 10 s
            with pytest.raises(SunRequestError, match="dec-a went offline") as e:
                h.wait(10)
            assert e.value.code == "worker_lost"
        assert star.client.dropped == {}, star.client.dropped     # no stray error for the finished one
        star.add_decoder("dec-b")
        r = star.client.generate("maths", p, max_new=6, timeout=20)
        assert r.tokens == star.expect("maths", p, 6) and r.workers == ["prefill-maths", "dec-b"]
    finally:
        star.close()
