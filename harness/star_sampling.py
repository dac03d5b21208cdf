"""Seeded sampling through a star, fitted against the target's exact distribution: the χ² tests
of tests/roles/test_seed_streams.py and test_suffix_seed_streams.py (a tiny table target whose
distribution over a few tokens is enumerable), on the in-memory bus or a broker."""
from __future__ import annotations

from edge.speculative.sampling import SamplingParams
from edge.star.target import Deadline
from edge.wire.memory_link import MemoryBus, MemoryLink
from harness.goodness_of_fit import chi_square, critical_value, exact_distribution


def memory_links():
    """(the Hub's keyword arguments for its link, a factory of the targets' links) on one bus."""
    bus = MemoryBus()
    return {"link": MemoryLink(bus, "hub")}, lambda name: MemoryLink(bus, name)


def seeded_fit(star, target, prompt, length: int, n: int, seed0: int, params: SamplingParams) -> tuple:
    """n generations of `length` tokens through `star` (StarTarget), seeds seed0, seed0 + 1, ...
    -> (chi2, df, critical value, {drafted, accepted}) of their outputs against `target`'s exact
    distribution under params (temperature 1)."""
    counts, drafted, accepted = {}, 0, 0
    for i in range(n):
        # a patient deadline: every round gets its drafts, however loaded the machine
        r = star.generate(prompt, length, SamplingParams(temperature=1.0, seed=seed0 + i),
                          deadline=Deadline(5.0, 5.0, 5.0))
        assert r.n_generated == length
        counts[tuple(r.tokens)] = counts.get(tuple(r.tokens), 0) + 1
        drafted, accepted = drafted + r.n_drafted, accepted + r.n_accepted
    stat, df = chi_square(counts, exact_distribution(target, prompt, length, params), n)
    return stat, df, critical_value(df), {"drafted": drafted, "accepted": accepted}
