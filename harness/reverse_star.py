"""The reverse star's process rows (tests/system/test_reverse_star_faults.py, _partition.py): a
hub that verifies on a tiny float64 model, a drafting device of the same model, and the text the
target alone gives (greedy: what every row must print, exactly)."""
from __future__ import annotations

from edge.engines.loader import open_model
from edge.speculative.generate import generate_plain
from edge.star.drafting_device import DraftingDevice
from edge.star.hub_client import HubClient
from edge.wire.link import MqttLink

from harness.star_processes import BIN

PROMPT = [3, 14, 15, 9, 26, 5]
MAX_NEW = 60


def hub_cmd(model, port):
    """`edge-hub serve` with its own Mosquitto on `port` and a verify service for `model`."""
    return [BIN / "edge-hub", "serve", "--mosquitto", "--port", port, "--verify-model", model, "--hub-id", "rv",
            "--threads", "1", "--dtype", "float64", "--stats-every", "0"]


def drafter(model, url, name, answer_timeout: float = 300.0, resend_after: float = 0.5) -> DraftingDevice:
    """A drafting device (γ = 3) on `model`, connected to the broker at `url` as `name`."""
    engine, tok = open_model(str(model), dtype="float64", threads=1, max_len=1024)
    link = MqttLink(url, client_id=name).connect(30)
    return DraftingDevice(engine, HubClient(link, name, tok.fingerprint(), engine.vocab_size, role="drafter"),
                          gamma=3, join_timeout=30.0, answer_timeout=answer_timeout, resend_after=resend_after)


def reference(model) -> list:
    """PROMPT's greedy continuation by the target alone."""
    engine, _ = open_model(str(model), dtype="float64", threads=1, max_len=1024)
    return generate_plain(engine, PROMPT, MAX_NEW).tokens


def close(dev: DraftingDevice) -> None:
    dev.close()
    dev.hub.link.close()
