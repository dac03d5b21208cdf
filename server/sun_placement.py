"""Which SUN workers a request goes to: the choosing rules of server/sun_router.py, kept pure.

Each function takes the online workers (sorted by id) and returns its pick or raises SunRefusal
with what to start. Loads are estimates (WorkerInfo.est_load: what a worker last reported plus
what was sent to it since); ties break by id, so with equal loads a task always lands on the
same worker.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Dict, List, Tuple

from edge.wire.protocol import E_BAD_REQUEST, E_NO_DECODER, E_OVERLOADED, E_UNKNOWN_TASK


class SunRefusal(Exception):
    def __init__(self, code: str, reason: str):
        super().__init__(reason)
        self.code, self.reason = code, reason


@dataclass
class WorkerInfo:
    id: str
    role: str
    task: str
    fingerprint: str
    vocab_size: int
    online: bool = True
    load: int = 0                 # as last reported
    capacity: int = 1
    max_load: int = 0             # it refuses past this load (0: it said no limit)
    served: int = 0               # jobs it had taken when it last reported
    sent: int = 0                 # jobs we sent it (the same count on our side)
    sent_at: float = 0.0          # when we last sent it one
    seen: float = field(default_factory=time.monotonic)
    tasks: Tuple[str, ...] = ()   # prefill: every task it serves (its adapters), else (task,)
    grammars: bool = False        # it follows a request's grammar (it holds the base's tokenizer)

    @property
    def est_load(self) -> int:
        return self.load + max(0, self.sent - self.served)


def short(fp: str) -> str:
    return fp if len(fp) <= 20 else fp[:12] + "…"


def pick_prefill(online: List[WorkerInfo], task: str) -> WorkerInfo:
    """The least-loaded online prefill worker serving `task` (a specialist or an adapter)."""
    mine = [w for w in online if task in w.tasks]
    if not mine:
        have = ", ".join(sorted({t for w in online for t in w.tasks})) or "none"
        raise SunRefusal(E_UNKNOWN_TASK, f"no prefill worker serves task {task!r} (tasks here: {have}); "
                                         f"start one with `edge-agent run --role prefill` and that "
                                         f"task's specialist, or add its adapter to a running worker "
                                         f"(`edge-agent add-adapter`)")
    return min(mine, key=lambda w: (w.est_load, w.id))


def following_grammars(fits: List[WorkerInfo], task: str, what: str) -> List[WorkerInfo]:
    """The workers of `fits` that follow grammars (a request with a grammar goes only to them);
    none: refused bad_request, saying what to start (fits is never empty here)."""
    mine = [w for w in fits if w.grammars]
    if not mine:
        raise SunRefusal(E_BAD_REQUEST, f"the request has a grammar (response_format or a forced tool_choice) "
                                        f"and no {what} for task {task!r} follows grammars "
                                        f"({', '.join(w.id for w in fits)}): start it with --tokenizer (the base "
                                        f"model's), or send the request without one")
    return mine


def decoders_for(online: List[WorkerInfo], task: str, fp: str) -> List[WorkerInfo]:
    """The online decoders whose fingerprint is the one `task`'s prefill module was tuned for."""
    fits = [d for d in online if d.fingerprint == fp]
    if not fits:
        have = ", ".join(sorted({short(d.fingerprint) for d in online})) or "none online"
        raise SunRefusal(E_NO_DECODER, f"task {task!r} was tuned for decoder {short(fp)}; the decoders "
                                       f"here are {have}: start `edge-agent run --role decoder` with "
                                       f"that decoder, or re-tune the specialist for one of them")
    return fits


def least_loaded(fits: List[WorkerInfo], task: str) -> WorkerInfo:
    """The least-loaded decoder below its limit (most capacity on a tie), or refuse `overloaded`."""
    room = [d for d in fits if not d.max_load or d.est_load < d.max_load]
    if not room:
        held = ", ".join(f"{d.id} {d.est_load}/{d.max_load}" for d in fits)
        raise SunRefusal(E_OVERLOADED, f"every decoder for task {task!r} holds its limit of sequences "
                                       f"({held}); retry later or add a decoder")
    return min(room, key=lambda d: (d.est_load, -d.capacity, d.id))


def isolated_pool(task: str, fits: List[WorkerInfo], pools: Dict[str, List[str]],
                  bindings: Dict[str, str]) -> List[WorkerInfo]:
    """The conventional baseline: `task`'s own decoders -- its named pool, else the one free decoder
    it binds the first time (recorded in `bindings`, sticky until that decoder goes offline)."""
    if task in pools:
        mine = [d for d in fits if d.id in pools[task]]
        if not mine:
            raise SunRefusal(E_NO_DECODER, f"isolated pools: none of task {task!r}'s decoders "
                                           f"({', '.join(pools[task])}) is online with its fingerprint")
        return mine
    bound = bindings.get(task)
    if bound is not None and any(d.id == bound for d in fits):
        return [d for d in fits if d.id == bound]
    taken = set(bindings.values()) | {d for ds in pools.values() for d in ds}
    free = [d for d in fits if d.id not in taken]
    if not free:
        raise SunRefusal(E_NO_DECODER, f"isolated pools: every decoder is bound to another task "
                                       f"({', '.join(f'{t}->{d}' for t, d in sorted(bindings.items()))}); "
                                       f"add a decoder for task {task!r} or run the shared pool")
    pick = min(free, key=lambda d: (d.est_load, d.id))
    bindings[task] = pick.id
    return [pick]
