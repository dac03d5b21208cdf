"""What one StarSD round sends through the broker, counted on a real star.

The protocol's round (edge/wire/topics.py, edge/star/): the target publishes a DraftRequest on
its session's `up` topic, the draft service answers with a DraftResponse (or an Error) on `down`;
the target verifies on its own device and folds the verify result into its next request (`keep`
and `append`), so a round is two publishes, each delivered to one subscriber. `ROUND_MESSAGES`
is that list, with the QoS the star publishes them at (edge/wire/link.py KINDS); the simulator
(benchmarks/lib/fleet_des.py) charges the broker for exactly these.

`count_star` runs generations through a real hub and target on any link (Mosquitto in
benchmarks/star/broker_costs.py, the in-memory bus in the tests) with a counting subscriber on
`#`, and splits what it saw into the rounds' messages and everything else (join, assign, status,
hellos, telemetry, bye), per topic kind, with payload and MQTT wire bytes.
"""
from __future__ import annotations

import threading
import time
from collections import defaultdict
from typing import Callable, Sequence

import msgpack

from edge.wire.link import KINDS
from edge.wire.protocol import DraftRequest, DraftResponse, ProtocolError, parse_topic

# (topic kind, message tag, QoS): what one round publishes, in order
ROUND_MESSAGES = (("up", DraftRequest.TAG, KINDS["draft"][0]),
                  ("down", DraftResponse.TAG, KINDS["draft"][0]))
ROUND_KINDS = tuple(f"{kind}:{tag}" for kind, tag, _ in ROUND_MESSAGES)


def mqtt_publish_bytes(topic: str, payload_len: int, qos: int) -> int:
    """Bytes of one MQTT 3.1.1 PUBLISH packet on the wire (its PUBACK too at QoS 1)."""
    body = 2 + len(topic.encode()) + (2 if qos else 0) + payload_len
    length_bytes = 1 if body < 128 else 2 if body < 16384 else 3 if body < 2097152 else 4
    return 1 + length_bytes + body + (4 if qos else 0)


def _topic_kind(topic: str) -> str:
    try:
        return parse_topic(topic)[0]
    except ProtocolError:
        return "other"


def _tag(payload: bytes) -> str:
    """The envelope's message tag (read, never trusted: nothing here acts on it)."""
    try:
        env = msgpack.unpackb(payload, raw=False)
        return str(env.get("t", "?")) if isinstance(env, dict) else "?"
    except Exception:
        return "?"


class Counter:
    """Counts what a subscriber on `#` sees, per topic kind."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.by_kind: dict = defaultdict(lambda: {"messages": 0, "payload_bytes": 0, "wire_bytes": 0})
        self.sizes: dict = defaultdict(list)      # payload sizes of the round's messages

    def __call__(self, topic: str, payload: bytes) -> None:
        if topic.startswith("$"):
            return
        kind = f"{_topic_kind(topic)}:{_tag(payload)}"
        qos = KINDS["draft"][0] if kind in ROUND_KINDS else KINDS["control"][0]
        with self.lock:
            c = self.by_kind[kind]
            c["messages"] += 1
            c["payload_bytes"] += len(payload)
            c["wire_bytes"] += mqtt_publish_bytes(topic, len(payload), qos)
            if kind in ROUND_KINDS:
                self.sizes[kind].append(len(payload))

    def snapshot(self) -> dict:
        with self.lock:
            return {k: dict(v) for k, v in self.by_kind.items()}


def count_star(link_of: Callable[[str], object], make_hub: Callable[[], object], target_engine,
               model_fp: str, prompts: Sequence[Sequence[int]], max_new: int, sampling,
               gamma: int = 4, settle_s: float = 0.3) -> dict:
    """Generate from `prompts` through a real star; count every message the broker carried.

    link_of(name): a connected-or-connectable Link for a client; make_hub(): a started Hub."""
    from edge.star.hub_client import HubClient
    from edge.star.target import StarTarget
    from edge.star.remote_round import Deadline

    counter = Counter()
    spy = link_of("fleet-count-spy").connect(10)
    spy.subscribe("#", counter)
    hub = make_hub()
    rounds = answered = tokens = drafted = accepted = 0
    try:
        star = StarTarget(target_engine, HubClient(link_of("fleet-count-t1").connect(10), "fleet-count-t1",
                                                   model_fp, target_engine.vocab_size), gamma=gamma)
        for p in prompts:
            res = star.generate(list(p), max_new, sampling, deadline=Deadline(30.0, 30.0, 30.0))
            st = star.last_drafter.stats
            rounds, answered = rounds + st.rounds, answered + st.answered
            tokens, drafted, accepted = tokens + res.n_generated, drafted + res.n_drafted, accepted + res.n_accepted
        time.sleep(settle_s)              # the last answers and byes reach the spy
        star.hub.link.close()
    finally:
        hub.stop()
        time.sleep(settle_s)
        spy.close()
    return summarize_counts(counter, rounds, answered, tokens, drafted, accepted, len(prompts))


def summarize_counts(counter: Counter, rounds: int, answered: int, tokens: int, drafted: int,
                     accepted: int, generations: int) -> dict:
    """Per round: the round's messages and bytes; apart: per generation, the rest."""
    kinds = counter.snapshot()
    in_round = {k: v for k, v in kinds.items() if k in ROUND_KINDS}
    rest = {k: v for k, v in kinds.items() if k not in ROUND_KINDS}
    per_round = {k: {f: v[f] / max(1, rounds) for f in v} for k, v in in_round.items()}
    sizes = {k: {"median": sorted(v)[len(v) // 2], "min": min(v), "max": max(v)}
             for k, v in counter.sizes.items() if v}
    return {"rounds": rounds, "answered": answered, "tokens": tokens, "drafted": drafted, "accepted": accepted,
            "generations": generations, "by_kind": kinds, "per_round": per_round, "payload_sizes": sizes,
            "round_messages": sum(v["messages"] for v in in_round.values()) / max(1, rounds),
            "round_payload_bytes": sum(v["payload_bytes"] for v in in_round.values()) / max(1, rounds),
            "round_wire_bytes": sum(v["wire_bytes"] for v in in_round.values()) / max(1, rounds),
            "setup_messages_per_generation": sum(v["messages"] for v in rest.values()) / max(1, generations),
            "other_kinds": sorted(rest)}
