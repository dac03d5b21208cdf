"""What the star-in-namespaces tests share: each prompt's one-process greedy text, one request on
several targets at once (harness/netns_star.py and netns_rabbit_star.py both have `complete`), and
rounds of those until the star drafted for them.

A target joins the star anew for each request and decodes alone when the hub's answer takes over
3 s (edge/star/target.py's join_timeout), as it may on a loaded machine: that one request's text
is the same, only undrafted. So a test that must see drafting waits for it as an event -- rounds
until the observer saw the draft answers -- instead of promising that one round drafts."""
from __future__ import annotations

import threading
import time
from typing import Callable, Dict, Iterable, Optional


def plain_texts(model, prompts: Dict[str, str], max_new: int) -> Dict[str, str]:
    """host -> the plain greedy text of its prompt in this process (what its target must print)."""
    from edge.engines.loader import open_model
    from edge.speculative.generate import generate_plain
    engine, tok = open_model(str(model), dtype="float64", threads=1, max_len=4096)
    out = {}
    for host, prompt in prompts.items():
        ids = tok.encode(prompt, add_special=True)
        ref = generate_plain(engine, ids, max_new, stop_ids=tuple(tok.eos_ids)).tokens
        stream = tok.decode_stream(skip_special=True)
        out[host] = "".join(stream.put(t) for t in ref)
    return out


def complete_at_once(star, prompts: Dict[str, str], max_new: int, timeout: float,
                     hosts: Iterable[str] = ()) -> Dict[str, dict]:
    """One request on each of `hosts` (default: every prompt's) in parallel -> host -> the answer;
    asserts that none failed (a timeout included), naming each that did."""
    got, errs = {}, []

    def one(h):
        try:
            got[h] = star.complete(h, prompts[h], max_new, timeout=timeout)
        except Exception as e:         # noqa: BLE001 -- named in the assertion below
            errs.append(f"{h}: {e!r}")
    ts = [threading.Thread(target=one, args=(h,)) for h in (list(hosts) or list(prompts))]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert not errs, errs
    return got


def rounds_until(star, prompts: Dict[str, str], refs: Dict[str, str], max_new: int, done: Callable[[], bool],
                 give_up_s: float, timeout: float = 60.0, hosts: Iterable[str] = (), pause_s: float = 0.0
                 ) -> Optional[int]:
    """Rounds of complete_at_once until done() -> the rounds made (0: done already); every answer
    must equal its one-process text (refs). None once give_up_s passed: a guard against a hang, not
    a measure. pause_s: between rounds (a fault test's rounds need not spin)."""
    give_up, n = time.monotonic() + give_up_s, 0
    while not done():
        if time.monotonic() > give_up:
            return None
        got = complete_at_once(star, prompts, max_new, timeout, hosts)
        for h, r in got.items():
            assert r["text"] == refs[h], (h, r["text"], refs[h])
        n += 1
        time.sleep(pause_s)
    return n
