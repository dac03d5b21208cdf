"""The hub's verify service (the reverse star), beside its draft service: devices that cannot hold
the target draft locally and join as role "drafter"; the hub's target verifies their drafts in
batch (edge/star/verify_service.py, edge/star/verify_node.py).

`VerifySide` is what server/hub.py holds for it: the node on a connection of its own (its own will,
so a killed hub leaves no online hello of it behind), a registry of its own that admits only
drafters (the same admission, client share, liveness and release rules as the draft services'),
and the counters `edge-hub top` and the hub's snapshot show.
"""
from __future__ import annotations

import logging
from typing import Optional

from edge.star.draft_limits import DraftLimits, DraftRefused
from edge.star.verify_node import VerifyNode
from edge.star.verify_service import VerifyService
from edge.wire.protocol import Join, Joined, down_topic, up_topic, verify_hello_topic
from server.registry import Refusal, Registry

log = logging.getLogger(__name__)


class VerifySide:
    def __init__(self, engine, tokenizer_fp: str, limits: Optional[DraftLimits] = None, ctl_key=None,
                 client_share: float = 0.5, grammar_tokenizer=None):
        if not tokenizer_fp:
            raise ValueError("the hub's verify service needs the tokenizer fingerprint of its target")
        self.engine, self.tokenizer_fp, self.ctl_key = engine, tokenizer_fp, ctl_key
        self.grammar_tokenizer = grammar_tokenizer    # response_format / tool_choice grammars (verify_rules.py)
        self.limits = limits or DraftLimits(ahead=False)
        self.registry = Registry(client_share=client_share, role="drafter")
        self.node: Optional[VerifyNode] = None
        self.link = None

    def start(self, hub_id: str, link, shared: bool) -> "VerifySide":
        """Serve on `link` (shared: the hub's own link, no will or connect of its own)."""
        vid = f"{hub_id}-verify"
        svc = VerifyService(self.engine, self.limits, name=vid, grammar_tokenizer=self.grammar_tokenizer)
        self.link = link
        self.node = VerifyNode(svc, link, vid, self.tokenizer_fp, ctl_key=self.ctl_key,
                               on_closed=lambda sid, why: self.registry.release(sid))
        if not shared:
            link.set_will(verify_hello_topic(vid), self.node.will())
            link.connect()
        self.refresh()
        self.node.start()
        log.info("hub %s: verify service %s on %s (%s)", hub_id, vid, self.engine.name, self.engine.where())
        return self

    def refresh(self) -> None:
        """The registry's view of the service (it is the hub's own: no hello needs to travel)."""
        self.registry.update_service(self.node.status(), local=self.node)
        self.registry.sweep()

    def admit(self, join: Join) -> tuple:
        """(service id, sid, secret) for a drafter's join, or Refusal with the reason."""
        svc, sid, secret = self.registry.admit(join)
        try:
            svc.local.assign(join.client, sid, secret)
        except DraftRefused as e:
            self.registry.release(sid)
            raise Refusal(e.reason) from None
        self.registry.update_service(svc.local.status(), local=svc.local)
        return svc.name, sid, secret

    def stop(self, announce: bool = True) -> None:
        if self.node is not None:
            self.node.stop(announce=announce)

    def snapshot(self) -> dict:
        st = self.node.service.stats.snapshot()
        c = st["counters"]
        drafted = c.get("drafted_in", 0)
        return {"id": self.node.id, "sessions": len(self.node.service.sessions()), **st,
                "acceptance": c.get("accepted", 0) / drafted if drafted else None,
                "dropped": self.node.dropped, "registry": self.registry.snapshot()}


def answer_drafter(side: Optional[VerifySide], join: Join, counters: dict) -> Joined:
    """The hub's answer to a drafter's join: a session at its verify service, or the reason why not."""
    try:
        if side is None:
            raise Refusal("this hub verifies no drafts: it has no verify service (start it with "
                          "`edge-hub serve --verify-model PATH`); a device that holds the target joins "
                          "as a StarSD target instead")
        service, sid, secret = side.admit(join)
    except Refusal as r:
        counters["refused"] += 1
        log.info("hub: refused drafter %s: %s", join.client, r.reason)
        return Joined(join.client, False, r.reason[:1024], nonce=join.nonce)
    counters["joins"] += 1
    return Joined(join.client, True, "", sid, secret, service, up_topic(join.client, sid, service),
                  down_topic(join.client, sid, service), join.nonce)
