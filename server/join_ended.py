"""The sessions a join names as ended by its client (Join.ended), released before it is admitted.

A target's bye goes to its session's draft service, which tells the hub (SessionRelease, or the hub's
own service's callback) only once its loop handled it, after the step it is in; the target's next
join comes to the hub directly. On a busy service the join came first, and a target running
--parallel N at its client limit of N was refused for sessions it had already ended (#44). So the
client names them (edge/star/ended_sessions.py), and the hub forgets this client's among them and
tells their services to close them too: a client cannot free its share at the hub and go on
drafting on them. The bye, when it comes, finds nothing left to close.
"""
from __future__ import annotations

from edge.wire.protocol import Join, SessionRelease, draft_ctl_topic, encode


def release_ended(registry, join: Join, link, ctl_key=None) -> int:
    """Release the sessions `join` names that its client holds in `registry`; how many."""
    released = registry.release_ended(join.client, join.ended) if join.ended else []
    for info in released:
        svc = registry.services.get(info.service)
        if svc is not None and svc.local is not None:
            svc.local.release(info.sid, "bye")            # the hub's own service: now, from this thread
        else:                                             # a device's: on its ctl topic, before any assign
            msg = SessionRelease(info.service, info.sid, "bye")
            link.publish(draft_ctl_topic(info.service), encode(msg, ctl_key), kind="control")
    return len(released)
