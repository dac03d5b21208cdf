"""A burst held in one long prefill step is prefilled once (issue 45), as a real `edge-agent run
--role prefill` process with adapters over a real Mosquitto, on a tiny float64 base.

The split layout's 64-task burst prefilled 31 jobs for 17 requests. A prefill worker with adapters
takes up to 8 queued prompts into one step, which on one loaded core runs for tens of seconds. Its
hello (the heartbeat's, while the step runs) said load 0: the jobs in the step were counted nowhere.
The router took "load 0, every job taken" for "idle" and forgot the jobs it had sent it, so the
clients' copies of those requests were no longer passed on to the worker that held them; nobody
answered them, and after SAME_COPIES copies each client sent its request again under a new id,
which was prefilled a second time.

Here the worker's first step takes the whole burst and is held open (harness/held_prefill_step.py)
until its heartbeat hellos have reached the router and the clients have sent copies well past the
point where they would give up; then it finishes, and every request is answered once, exactly.
"""
from __future__ import annotations

import re
import sys

from edge.model.sun_modules import load_module
from edge.sun.client import SAME_COPIES, SunClient
from edge.sun.decoder import SharedDecoder
from edge.sun.decoder_node import DecoderNode
from harness.star_processes import Procs, sun_dirs
from harness.sun_adapters import Reference, trained_adapter
from harness.sun_star import KEY, Star, prompts
from harness.waiting import wait_until

WORKER, DECODER = "prefill-held", "dec-a"
BURST = 4                      # requests of the burst, all in the worker's first step
CLAIM_S = 0.25                 # the client's silence before a copy (2 s in a hub): the test's pace
MAX_NEW = 8


def clean(star, node) -> bool:
    """Nothing left held: the router's tables, the decoder's reservations and sequences."""
    r = star.router
    return (not any(r.inflight.values()) and not any(r.prefilling.values()) and not node._pending
            and not node._live and node.decoder.load == 0)


def test_a_burst_in_one_long_prefill_step_is_prefilled_once(mosquitto, tmp_path):
    dec_dir, _ = sun_dirs(tmp_path)
    base, _ = load_module(dec_dir)
    tasks = ("code", "maths")
    dirs = {t: trained_adapter(base, tmp_path / "peft", t, seed=i + 1)[0] for i, t in enumerate(tasks)}
    ref = Reference(base, dirs)
    key, gate = tmp_path / "ctl.key", tmp_path / "gate"
    key.write_bytes(KEY)
    gate.mkdir()
    star = Star(mosquitto.url, (None, "", {}), decoders=(), tasks=())
    node = star._start(lambda ln: DecoderNode(SharedDecoder.from_dir(dec_dir, threads=1), ln, DECODER, KEY), DECODER)
    router = star.router
    router._routes.every = CLAIM_S / 2                     # re-deliveries at the client's pace
    hellos = []                                           # the worker's hellos, as the router takes them
    update = router.update_worker

    def heard(h):
        if h.worker == WORKER:
            hellos.append(h)
        update(h)
    router.update_worker = heard
    client = SunClient(star.link("app").connect(5), "app", claim_s=CLAIM_S).start()
    ps = Procs(tmp_path)
    ps.env.update(STARSUN_HELD_STEP=str(gate), STARSUN_HELD_ROWS=str(BURST))
    ps.start("prefill", sys.executable, "-m", "harness.held_prefill_step", "run", "--role", "prefill",
             "--module", dec_dir, "--broker", mosquitto.url, "--client-id", WORKER, "--threads", "1",
             "--ctl-key-file", key, *[x for t in tasks for x in ("--adapter", f"{t}={dirs[t]}")])
    try:
        assert wait_until(lambda: WORKER in router.workers and router.workers[WORKER].online, 90), ps.err("prefill")
        jobs = list(zip(tasks * (BURST // 2), prompts(BURST, seed=61)))
        handles = [client.submit(t, p, max_new=MAX_NEW) for t, p in jobs]
        assert wait_until(lambda: (gate / "stepping").exists(), 90), ps.err("prefill")
        assert (gate / "stepping").read_text().split() == [str(BURST)], "the first step did not take the burst"
        n0 = len(hellos)
        # two hellos since the step began: at least one is the heartbeat's, sent while the step runs
        assert wait_until(lambda: len(hellos) >= n0 + 2, 90), "the worker said no hello while its step ran"
        asked = [h.reasked for h in handles]
        # past the point where a client whose copies go unanswered gives its request a new id
        assert wait_until(lambda: any(h.resent for h in handles)
                          or all(h.reasked >= a + SAME_COPIES + 2 for h, a in zip(handles, asked)), 90)
        during = [h.load for h in hellos[n0:]]
        assert [h.resent for h in handles] == [0] * BURST, (
            f"a request held in the worker's step was sent again under a new id (prefilled twice); the "
            f"worker's hellos during the step said load {during}")
        assert min(during) == BURST, f"the worker's hellos during its step said load {during}: its jobs uncounted"
        assert router.counters["routed"] == BURST and ps.procs["prefill"].poll() is None
        (gate / "open").touch()
        for h, (t, p) in zip(handles, jobs):
            r = h.wait(60)
            assert r.tokens == ref.expect(t, p, MAX_NEW) and r.workers == [WORKER, DECODER], t
        assert router.counters["routed"] == BURST and node.stats["admitted"] == BURST
        assert wait_until(lambda: clean(star, node), 90)
        assert ps.stop("prefill") == 0, ps.err("prefill")
        prefilled = re.search(r"'jobs': (\d+)", ps.err("prefill"))
        assert prefilled and int(prefilled.group(1)) == BURST, ps.err("prefill")[-2000:]
    finally:
        (gate / "open").touch()
        ps.close()
        client.close()
        star.close()
