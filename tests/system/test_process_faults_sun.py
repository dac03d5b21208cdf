"""Process faults of the SUN star (issue 12, part 3): kill -9 of a shared decoder mid-stream and
of a prefill worker holding jobs, as real `edge-agent run` processes over real Mosquitto.

A request on a dead worker is sent again (prefilled again, decoded on a live decoder) or fails
at once with an error that says what is missing; no token is handed out twice; nothing leaks
(the router's in-flight tables, the decoders' reservations); the worker rejoins when it is back.
"""
from __future__ import annotations

import os

import pytest
import torch

from edge.wire.link import MqttLink
from edge.sun.client import SunClient, SunRequestError
from server.hub import Hub

from harness.star_processes import BIN, Procs, sun_dirs, wait_until

torch.set_num_threads(1)
PID = os.getpid()                       # ids of this run: a shared broker may hold older hellos
AGENT = [BIN / "edge-agent", "run", "--threads", "1", "--dtype", "float64"]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("sun-faults")
    dec_dir, maths_dir = sun_dirs(root)
    return root, None, dec_dir, maths_dir


@pytest.fixture(scope="module")
def sun_ref(files):
    """The in-process answer of a prompt: the specialist's prefill, then the shared decoder."""
    from edge.sun.decoder import SharedDecoder
    from edge.sun.prefill import PrefillWorker
    _, _, dec_dir, maths_dir = files
    pre, dec = PrefillWorker.from_dir(maths_dir, threads=1), SharedDecoder.from_dir(dec_dir, threads=1)

    def ref(prompt, max_new):
        out = pre.prefill(prompt)
        rid = dec.admit(out.blob, max_new=max_new, first_token=out.first_token)
        while rid not in dec.results:
            dec.step()
        return dec.results.pop(rid).tokens
    return ref


@pytest.fixture(scope="module")
def sun_star(mosquitto, files):
    """An in-process hub (router + a shared decoder of its own, batch 4) and, as processes, a
    prefill worker and a decoder (batch 64: least-loaded routing prefers it). Each test leaves
    the star as it found it (what it killed, it starts again)."""
    from edge.sun.decoder import SharedDecoder
    root, _, dec_dir, maths_dir = files
    procs = Procs(root / "sun")
    procs.root.mkdir()
    ids = {"prefill": f"pre-{PID}", "decoder": f"dec-{PID}"}
    cmds = {"prefill": [*AGENT[:2], "--threads", "1", "--role", "prefill", "--broker", mosquitto.url,
                        "--module", maths_dir, "--task", "maths", "--client-id", ids["prefill"]],
            "decoder": [*AGENT[:2], "--threads", "1", "--role", "decoder", "--broker", mosquitto.url,
                        "--module", dec_dir, "--client-id", ids["decoder"], "--max-batch", "64"]}
    for name, cmd in cmds.items():
        procs.start(name, *cmd)
    hub = Hub(broker_url=mosquitto.url, hub_id=f"hs{PID}",
              sun_decoder=SharedDecoder.from_dir(dec_dir, threads=1, max_batch=4, name=f"hs{PID}-decoder")).start()
    client = SunClient(MqttLink(mosquitto.url).connect(10), f"app-{PID}").start()

    def online(*names):
        return wait_until(lambda: all(n in hub.router.workers and hub.router.workers[n].online for n in names), 60)
    try:
        assert online(ids["prefill"], ids["decoder"], hub.sun_node.id), (procs.err("prefill"), procs.err("decoder"))
        yield hub, client, procs, ids, cmds, online
    finally:
        client.close()
        client.link.close()
        hub.stop()
        procs.close()


def sun_clean(hub):
    """Nothing left in flight: the router's tables, the hub decoder's reservations and sequences."""
    r, node = hub.router, hub.sun_node
    return (not any(r.inflight.values()) and not any(r.prefilling.values()) and not node._pending
            and not node._live and node.decoder.load == 0 and node.decoder.engine.active_sequences == 0)


def test_sun_decoder_killed_mid_stream_is_rerouted(sun_star, sun_ref):
    hub, client, procs, ids, cmds, online = sun_star
    prompt, max_new = [5, 17, 99, 3, 42, 7], 600
    ref = sun_ref(prompt, max_new)
    told = []

    def on_token(i, t):
        told.append((i, t))
        if len(told) == 3:                        # mid-stream on the decoder process: freeze, kill
            procs.pause("decoder")
            procs.procs["decoder"].kill()
    lost = hub.router.counters.get("worker_lost", 0)
    h = client.submit("maths", prompt, max_new=max_new, on_token=on_token)
    r = h.wait(30)
    procs.procs["decoder"].wait(10)
    assert r.tokens == ref and told == list(enumerate(ref)), "a token was lost, changed or repeated"
    assert h.resent == 1, "the request ended before the decoder was killed"
    assert r.workers == [ids["prefill"], hub.sun_node.id]
    assert hub.router.counters.get("worker_lost") == lost + 1
    assert wait_until(lambda: sun_clean(hub))
    assert not hub.router.workers[ids["decoder"]].online
    procs.start("decoder", *cmds["decoder"])      # it comes back and gets the work again
    assert online(ids["decoder"])
    r = client.generate("maths", prompt, max_new=20, timeout=30)
    assert r.tokens == ref[:20] and r.workers == [ids["prefill"], ids["decoder"]]
    assert wait_until(lambda: sun_clean(hub))


def test_sun_prefill_killed_holding_jobs_fails_them_at_once(sun_star, sun_ref):
    hub, client, procs, ids, cmds, online = sun_star
    router = hub.router
    lost = router.counters.get("worker_lost", 0)
    procs.pause("prefill")                        # it takes jobs and answers nothing
    prompts = [[200, 11, 64, 8], [9, 8, 7]]
    handles = [client.submit("maths", p, max_new=8) for p in prompts]
    assert wait_until(lambda: sum(len(v) for v in router.prefilling.values()) == 2)
    procs.kill9("prefill")
    for h in handles:                             # sent again, then told no prefill serves the task
        with pytest.raises(SunRequestError, match="no prefill worker serves task 'maths'") as e:
            h.wait(10)                            # well before the decoders' 30 s KV timeout
        assert e.value.code == "unknown_task" and h.resent == 1
    assert router.counters.get("worker_lost") == lost + 2
    # the decoders' reservations are released now (their hellos report no load), not at their KV timeout
    assert wait_until(lambda: sun_clean(hub) and all(w.load == 0 for w in router.workers.values()
                                                     if w.role == "decoder" and w.online))
    procs.start("prefill", *cmds["prefill"])
    assert online(ids["prefill"])
    for p in prompts:
        assert client.generate("maths", p, max_new=8, timeout=30).tokens == sun_ref(p, 8)
    assert wait_until(lambda: sun_clean(hub))
