"""A conversation's next turn over a long cache, through a real star (Mosquitto, hub, draft service,
StarTarget with its prompt cache; SmolLM2-135M on llama.cpp): the target's prompt cache and the
draft service both feed a few held tokens again so that the short new turn is one tiled call
(edge/engines/llamacpp_tiles.py), the target takes its first token from its own prefill, and the
star's greedy text equals the target's alone (with its own prompt cache) on both turns."""
from __future__ import annotations

import pytest

from edge.engines.llamacpp_tiles import FA_TILE_ROWS
from edge.speculative.generate import generate_plain
from edge.speculative.prefix_cache import PrefixCache
from edge.wire.link import MqttLink
from harness.gguf_star import PROMPT, Star, engine
from harness.waiting import wait_until

pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (make install)")

TURN1 = PROMPT + [(37 * i) % 20000 + 100 for i in range(370)]      # a long shared prefix
NEW = [(91 * i) % 20000 + 150 for i in range(41)]                  # the next user message
N = 24


def two_turns(generate) -> list:
    one = generate(TURN1)
    two = generate(TURN1 + one.tokens + NEW)
    return [one, two]


def test_the_next_turn_through_the_star_equals_the_target_alone(mosquitto):
    alone, cache = engine(), None
    cache = PrefixCache(alone, slots=2)
    want = two_turns(lambda p: generate_plain(alone, p, N, cache=cache))
    held = len(TURN1) + N - 1                                      # a reply's last token is never fed
    assert want[1].cached_tokens == len(TURN1) + N + len(NEW) - FA_TILE_ROWS < held     # fed again: a tile
    star = Star(MqttLink(mosquitto.url), MqttLink(mosquitto.url), MqttLink(mosquitto.url), "nt1")
    try:
        star.target.prefix_cache = PrefixCache(star.target.engine, slots=2)
        assert wait_until(lambda: "draft1" in star.hub.registry.online_services(), 60)
        got = two_turns(lambda p: star.target.generate(p, N))
        assert [r.tokens for r in got] == [r.tokens for r in want]
        assert got[1].cached_tokens == want[1].cached_tokens
        assert star.target.last_drafter.stats.answered > 0 and got[1].n_accepted > 0    # it speculated
    finally:
        star.close()
