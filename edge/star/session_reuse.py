"""A StarSD target's hub session kept from one generation to the next, so the draft keeps its KV.

With a prompt cache (edge/speculative/prefix_cache.py) the target reuses its own KV for a
conversation's next turn; the draft service (edge/star/draft_service.py) keeps a session's KV
between requests too, and cuts it back to the common prefix of what it fed and the context a
request names. So the target keeps its session instead of saying bye, and the next
generation's first request names keep = the common prefix of the new prompt and what the
draft surely holds of the last context (RemoteDrafter.held_for): the draft prefills only
the new turn. Nothing on the wire changes: a session's request may always rewind its context.

A session idle for longer than `max_idle_s` is closed and a new one joined: the draft service
evicts a silent session (its --evict-after, 60 s by default), and a request on an evicted
session would cost a rejoin in the middle of the generation. A session the hub lost (a
restart) is joined again as well.

A target serving several requests at once (--parallel N) keeps up to N sessions, one per
conversation that ended last; a conversation's next turn takes its own (best_kept), so N agents
taking turns each find their conversation at the draft.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

from edge.speculative.common_prefix import common_prefix
from edge.star.hub_client import Session
from edge.star.remote_drafter import RemoteDrafter

KEEP_SESSION_S = 45.0       # under the draft service's default eviction of silent sessions (60 s)


@dataclass
class KeptSession:
    session: Session
    held: Tuple[int, ...]       # the first tokens of the last context the draft surely holds
    since: float                # time.monotonic() when its generation ended


def keep_session(drafter: RemoteDrafter, context: Sequence[int]) -> Optional[KeptSession]:
    """End a generation without closing its session (None, and closed, when there is none to keep).
    context: the generation's committed tokens, prompt included."""
    s = drafter.session
    if s is None or s.lost:
        drafter.close()
        return None
    held = tuple(int(t) for t in context[:drafter.held_for(context)])
    drafter.session = None          # close() now only abandons a join still on its way
    drafter.close()
    return KeptSession(s, held, time.monotonic())


def best_kept(kept: List[KeptSession], prompt: Sequence[int], room: bool = False) -> Optional[KeptSession]:
    """The kept session a new prompt takes (removed from `kept`), or None: join anew.

    A conversation's next turn (its prompt extends all the draft held) or the same conversation
    asked again (the prompt lies within what the draft held: a regenerated answer, a repeated
    prompt) takes that session, the longest such. Another prompt joins anew while there is
    `room` for one more session (the kept ones stay for their own conversations' next turns);
    without room it takes the one holding the longest prefix of it, the latest on a tie, or the
    oldest when none shares any."""
    if not kept:
        return None
    prompt = [int(t) for t in prompt]
    shared = [common_prefix(k.held, prompt) for k in kept]
    ahead = [i for i, k in enumerate(kept)
             if shared[i] > 0 and (shared[i] == len(k.held) or shared[i] >= len(prompt) - 1)]
    if ahead:
        return kept.pop(max(ahead, key=lambda i: (shared[i], kept[i].since)))
    if room:
        return None
    best = max(range(len(kept)), key=lambda i: (shared[i], kept[i].since))
    if shared[best] == 0:
        best = min(range(len(kept)), key=lambda i: kept[i].since)
    return kept.pop(best)


def resume(kept: Optional[KeptSession], drafter: RemoteDrafter, prompt: Sequence[int],
           max_idle_s: float = KEEP_SESSION_S) -> bool:
    """Let `drafter` draft on the kept session: True, or False (closed if stale or lost: join anew)."""
    if kept is None:
        return False
    if kept.session.lost or time.monotonic() - kept.since > max_idle_s:
        kept.session.close()
        return False
    drafter.adopt(kept.session, common_prefix(kept.held, [int(t) for t in prompt]))
    return True
