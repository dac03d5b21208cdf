"""Shared pieces of the property-based fuzz tests (hypothesis): reproducible settings and
strategies for hostile values.

`fuzz(n)` is the settings every fuzz test uses: derandomized (the same examples on every
run and machine, so CI is reproducible and a failure replays), no example database
(nothing written into the tree), no per-example deadline (machines are noisy; a hang is
caught by the test's own bound, not by timing), and `n` examples -- sized so each test
runs in a few seconds.
"""
from __future__ import annotations

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st


def fuzz(max_examples: int):
    return settings(derandomize=True, database=None, deadline=None, max_examples=max_examples,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                           HealthCheck.filter_too_much])


# scalars msgpack can carry, edge cases first (hypothesis shrinks towards them)
_ints = st.one_of(st.sampled_from([0, 1, -1, 2**31, 2**32, 2**63 - 1, -2**63, 2**64 - 1]),
                  st.integers(-2**63, 2**64 - 1))
_floats = st.floats(allow_nan=True, allow_infinity=True)
MSGPACK_SCALARS = st.one_of(st.none(), st.booleans(), _ints, _floats, st.text(max_size=40),
                            st.binary(max_size=64))
# any msgpack value: nested lists and maps with str or bytes keys
MSGPACK_VALUES = st.recursive(
    MSGPACK_SCALARS,
    lambda inner: st.one_of(st.lists(inner, max_size=6),
                            st.dictionaries(st.one_of(st.text(max_size=12), st.binary(max_size=8)), inner,
                                            max_size=6)),
    max_leaves=20)

# any JSON value (what an HTTP client can put in a body)
JSON_SCALARS = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70),
                         st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=40))
JSON_VALUES = st.recursive(
    JSON_SCALARS,
    lambda inner: st.one_of(st.lists(inner, max_size=6), st.dictionaries(st.text(max_size=12), inner, max_size=6)),
    max_leaves=20)
