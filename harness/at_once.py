"""Calls run at once, each in its own thread, started together: what the tests of concurrent
generations and requests share (N targets through one draft, N requests to one endpoint)."""
from __future__ import annotations

import threading
from typing import Callable, List, Sequence


def all_at_once(calls: Sequence[Callable[[], object]], timeout: float = 60.0) -> List[object]:
    """Each call's result, in order; the calls start together (a barrier) and are waited for
    `timeout` s each. An AssertionError lists what any of them raised."""
    out, errors = [None] * len(calls), []
    start = threading.Barrier(len(calls))

    def run(i: int) -> None:
        try:
            start.wait()
            out[i] = calls[i]()
        except BaseException as e:       # noqa: BLE001 (reported below)
            errors.append(e)
    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(calls))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    assert not errors, errors
    return out
