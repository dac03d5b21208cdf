"""An outage leaves one INFO line when drafting comes back: through which broker, how long after
the loss (edge/star/hub_client.py; the link's own move to another broker: tests/unit/test_broker_list.py)."""
import logging
import re

import torch

from edge.speculative.generate import generate_plain
from edge.star.hub_client import HubClient
from edge.star.target import StarTarget
from edge.wire.memory_link import MemoryBus, MemoryLink
from harness.draft_services import make_engine
from server.hub import Hub

torch.set_num_threads(1)


def test_drafting_resumed_after_a_broker_outage_is_logged(caplog):
    bus = MemoryBus()
    hub = Hub(link=MemoryLink(bus, "hub"), draft_engine=make_engine(seed=1), tokenizer_fp="tok").start()
    try:
        target = make_engine(seed=0)
        star = StarTarget(target, HubClient(MemoryLink(bus, "t1"), "t1", "tok", 256), gamma=3)
        with caplog.at_level(logging.INFO, logger="edge.star.hub_client"):
            star.generate([1, 2, 3, 4], 12)
            assert star.last_drafter.stats.answered > 0
            assert not [r for r in caplog.records if "drafting resumed" in r.getMessage()], "no outage yet"
            bus.go_down()
            bus.come_up()
            got = star.generate([1, 2, 3, 4], 12)
        assert got.tokens == generate_plain(target, [1, 2, 3, 4], 12).tokens
        assert star.last_drafter.stats.answered > 0        # (a first answer has 0.5 s: Deadline)
        resumed = [r for r in caplog.records if "drafting resumed" in r.getMessage()]
        assert len(resumed) == 1 and resumed[0].levelno == logging.INFO
        assert re.fullmatch(r"t1: drafting resumed through broker memory://, \d+\.\d\d s after losing broker "
                            r"memory://", resumed[0].getMessage()), resumed[0].getMessage()
        star.hub.close()
    finally:
        hub.stop()
