"""A small real star for broker tests: a hub, a remote draft service and one target, each on its
own MQTT link (maybe its own broker node), SmolLM2-135M (GGUF, llama.cpp) for draft and target.

The draft service says hello once (no periodic hello), before the hub exists: a hub that cannot
read retained hellos (a RabbitMQ cluster, a bridge) finds it only by discovery."""
from __future__ import annotations

from pathlib import Path

from edge.engines.loader import load_engine
from edge.star.draft_node import DraftNode
from edge.star.draft_service import DraftLimits, DraftService
from edge.star.hub_client import HubClient
from edge.star.target import StarTarget
from edge.wire.protocol import draft_hello_topic
from harness.waiting import wait_until
from server.hub import Hub

GGUF = Path(__file__).resolve().parents[1] / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
FP = "smollm2-135m-gguf"          # one tokenizer: draft and target load the same file
VOCAB = 49152
PROMPT = [1, 504, 3458, 282, 4649, 314, 216]
MAX_NEW = 96
JOIN_WAIT_S = 60.0                # a hang guard for the hub's answer to a join, not a measure


def engine():
    return load_engine(GGUF, backend="llamacpp", threads=1, max_len=512)


def greedy_tokens() -> list:
    """PROMPT's MAX_NEW greedy tokens from the model alone: what the star must give."""
    from edge.speculative.generate import generate_plain
    return generate_plain(engine(), PROMPT, MAX_NEW).tokens


class Star:
    def __init__(self, hub_link, draft_link, target_link, client: str):
        self.links = [hub_link, draft_link, target_link]
        self.node = DraftNode(DraftService(engine(), DraftLimits(ahead=False), name="draft1"), draft_link,
                              "draft1", FP, hello_every=3600.0)
        draft_link.set_will(draft_hello_topic("draft1"), self.node.will())
        draft_link.connect(20)
        self.node.start()                                           # announced before the hub exists
        self.hub = Hub(link=hub_link, sun=False, status_every=1.0).start()
        # a generation's join waits for the hub's answer (3 s by default, then it decodes alone): the
        # tests assert that the star drafted, and a loaded machine may answer later than that
        self.target = StarTarget(engine(), HubClient(target_link.connect(20), client, FP, VOCAB), gamma=4,
                                 join_timeout=JOIN_WAIT_S)

    def run(self, on_token=None) -> list:
        """The target's greedy tokens for PROMPT, once the hub has found the draft service."""
        assert wait_until(lambda: "draft1" in self.hub.registry.online_services(), 60), \
            f"the hub never found the draft service: {self.hub.registry.snapshot()}"
        return self.target.generate(PROMPT, MAX_NEW, on_token=on_token).tokens

    def close(self) -> None:
        self.node.stop(announce=False)
        self.hub.stop()
        for link in self.links:
            link.close()
