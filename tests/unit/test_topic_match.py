"""edge/wire/topic_match.py answers what paho-mqtt's topic_matches_sub answers, on every pair of
short filters and topics over a few levels (wildcards, `$` topics, empty levels)."""
import itertools

from paho.mqtt.client import topic_matches_sub as paho_matches

from edge.wire.topic_match import topic_matches_sub

FILTER_LEVELS = ["a", "b", "+", "#", "", "$s"]
TOPIC_LEVELS = ["a", "b", "", "$s", "+", "#"]


def _joined(levels, most):
    return ["/".join(p) for n in range(1, most + 1) for p in itertools.product(levels, repeat=n)]


def test_every_short_filter_and_topic_matches_as_paho_says():
    filters, topics = _joined(FILTER_LEVELS, 3), _joined(TOPIC_LEVELS, 3)
    wrong = [(f, t) for f in filters for t in topics if topic_matches_sub(f, t) != paho_matches(f, t)]
    assert wrong == [], wrong[:10]
    assert len(filters) * len(topics) > 50_000


def test_the_stars_own_topics():
    assert topic_matches_sub("starsun/v1/draft/+/resp/+", "starsun/v1/draft/hub-1/resp/t1")
    assert topic_matches_sub("starsun/v1/#", "starsun/v1")
    assert not topic_matches_sub("starsun/v1/+", "starsun/v1/a/b")
    assert not topic_matches_sub("#", "$SYS/broker/load") and topic_matches_sub("$SYS/#", "$SYS/broker/load")
