"""A verify service (the reverse star) on the MQTT star: the draft node's machinery, another core.

Everything a draft service's node does -- one wildcard subscription over its sessions' up topics,
each message opened with its session's key (bad HMAC, replayed seq, unknown session: dropped and
counted), sessions assigned by the hub, eviction of silent ones, signed answers on the down topic,
a retained hello and a last will -- is edge/star/draft_node.py's. Only the requests (VerifyRequest)
and where it says hello (ss/hub/verifiers/{service}, so no hub takes it for a draft service) differ.
"""
from __future__ import annotations

from edge.star.draft_node import DraftNode
from edge.wire.protocol import VerifyRequest, verify_hello_topic


class VerifyNode(DraftNode):
    role = "verify"
    requests = VerifyRequest

    def hello_topic(self) -> str:
        return verify_hello_topic(self.id)

    def telemetry(self) -> dict:
        """The draft node's counters (edge/telemetry/readings.py); `tokens` are the tokens its
        verdicts committed, `accepted` / `drafted` the drafts it verified."""
        out = super().telemetry()
        c = self.service.stats.snapshot()["counters"]
        out.update(accepted=c.get("accepted", 0), drafted=c.get("drafted_in", 0))
        return out
