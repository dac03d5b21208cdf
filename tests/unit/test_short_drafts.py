"""A drafter that sends fewer drafts than asked (a draft service unsure of the rest:
--draft-p-min): for the adaptive γ the missing ones failed, so α measures what asking for γ
yields, not only how often the drafts that came were right."""
from edge.speculative.generate import ModelDrafter, generate_plain, generate_speculative
from edge.speculative.remote_gamma import RemoteGamma

from harness.table_engine import TableEngine


class OneOfAsked(ModelDrafter):
    """The target's own model (every draft right), but one draft whatever γ is asked."""

    def gamma_policy(self, max_gamma):
        # no round trips recorded: the policy keeps asking its first γ (4), so each round asks 4
        self.policy = RemoteGamma(max_gamma, explore_gamma=4)
        return self.policy

    def draft(self, context, gamma, rng):
        tokens, qs = super().draft(context, gamma, rng)
        return tokens[:1], qs[:1]


def test_drafts_not_sent_count_as_rejections_for_the_adaptive_gamma():
    target = TableEngine(seed=4, window=2)
    drafter = OneOfAsked(TableEngine(seed=4, window=2))
    got = generate_speculative(target, drafter, [1, 2, 3], 40, gamma=4, adaptive=True)
    assert got.tokens == generate_plain(target, [1, 2, 3], 40).tokens
    assert got.n_accepted == got.n_drafted > 0                 # each draft that came was right ...
    assert set(got.gammas[:-1]) == {4}
    assert abs(drafter.policy.acceptance.alpha - 0.5) < 0.05   # ... but asking 4 yields 1 of them
