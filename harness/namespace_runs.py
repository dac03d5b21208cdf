"""What the star-in-namespaces tests share: each prompt's one-process greedy text, and one request
on several targets at once (harness/netns_star.py and netns_rabbit_star.py both have `complete`)."""
from __future__ import annotations

import threading
from typing import Dict, Iterable


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
