"""The two-device table's per-prompt measurement: a draft that learns from every session (the fleet
suffix tree) runs through the star once a prompt, while the target alone keeps its median."""
from types import SimpleNamespace

import torch

from edge.engines.torch_engine import TorchEngine
from edge.speculative.generate import generate_plain
from edge.model.transformer import Transformer, tiny_config
from edge.speculative.remote_gamma import RoundTrips
from edge.star.remote_round import DrafterStats
from server.demos.two_device import measure_prompt, parse_modes


class Star:
    """A StarTarget's surface measure_prompt reads; it decodes alone and counts its runs."""

    def __init__(self, engine):
        self.engine, self.runs, self.gamma, self.adaptive = engine, 0, 0, False
        self.last_drafter = SimpleNamespace(stats=DrafterStats(), waits=RoundTrips())

    def generate(self, ids, max_new, stop_ids=()):
        self.runs += 1
        return generate_plain(self.engine, ids, max_new, stop_ids=stop_ids)


def tiny_engine():
    torch.manual_seed(0)
    return TorchEngine(Transformer(tiny_config("llama")).double(), fingerprint="tiny")


def test_a_learning_draft_sees_each_prompt_once_the_target_alone_three_times():
    eng = tiny_engine()
    star = Star(eng)
    row = measure_prompt(eng, star, [1, 2, 3], 6, parse_modes("auto"), rounds=3, star_rounds=1)
    assert star.runs == 1 and row["gauto"]["same_text"] and row["alone_tok_s"] > 0


def test_a_model_draft_runs_every_round_and_mode():
    eng = tiny_engine()
    star = Star(eng)
    measure_prompt(eng, star, [1, 2, 3], 6, parse_modes("3,auto"), rounds=2)
    assert star.runs == 4


def test_auto_asked_is_gamma_auto_with_the_older_pricing_side_by_side():
    """`auto-asked` (A/B runs): γ=auto whose rounds are priced as if every draft asked were sent."""
    import pytest
    assert parse_modes("3,auto,auto:5-asked") == [("3", 3, False), ("auto", 8, True), ("auto:5-asked", 5, True)]
    with pytest.raises(ValueError, match="pricing of γ=auto"):
        parse_modes("3-asked")
    eng = tiny_engine()
    star = Star(eng)
    seen = []
    run = star.generate
    star.generate = lambda *a, **k: (seen.append((star.adaptive, star.stop_aware)), run(*a, **k))[1]
    row = measure_prompt(eng, star, [1, 2, 3], 6, parse_modes("auto,auto-asked"), rounds=1)
    assert seen == [(True, True), (True, False)] and {"gauto", "gauto-asked"} <= set(row)
