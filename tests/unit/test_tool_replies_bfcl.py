"""Replies Qwen2.5-Coder-0.5B / 1.5B (Q4_K_M, greedy, our rendering of their chat templates) wrote to
BFCL cases with tools offered (benchmarks/serving/agent_workload), read by the Qwen family's parser
whole and streamed at every split: a fenced call is a call -- and one call, though the parallel
case asked for two (the model wrote one: the 0/100 of the parallel category is the model's) --;
a call shown inside prose, or naming a tool that was not offered, stays text."""
import json

import pytest

from edge.api.tool_formats import FAMILIES
from edge.api.tool_formats.stream import CallStream

QWEN = FAMILIES["qwen"]


def read(text, names):
    """(content, [(name, arguments)]) of the whole reply; every two-part split streams the same."""
    p = CallStream(QWEN, names)
    p.feed(text)
    p.finish()
    got = (p.content, [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in p.calls])
    for k in range(len(text) + 1):
        s = CallStream(QWEN, names)
        s.feed(text[:k])
        s.feed(text[k:])
        s.finish()
        assert (s.content, [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in s.calls]) == got
    return got


def test_parallel_0_one_fenced_call_where_two_were_asked():
    # 0.5B, "Play songs from Taylor Swift and Maroon 5, 20 and 15 minutes respectively": one call, then EOS
    text = ('```json\n{\n  "name": "spotify_play",\n  "arguments": {\n    "artist": "Taylor Swift",\n'
            '    "duration": 20\n  }\n}\n```')
    assert read(text, ["spotify_play"]) == ("", [("spotify_play", {"artist": "Taylor Swift", "duration": 20})])


def test_parallel_6_floats_and_the_1_5b_alike():
    text = ('```json\n{\n  "name": "calculate_sales_tax",\n  "arguments": {\n    "purchase_amount": 30.45,\n'
            '    "city": "Chicago",\n    "state": "Illinois"\n  }\n}\n```')
    assert read(text, ["calculate_sales_tax"])[1] == [
        ("calculate_sales_tax", {"purchase_amount": 30.45, "city": "Chicago", "state": "Illinois"})]


@pytest.mark.parametrize("text, names", [
    # multiple_138: the call shown as an example inside an explanation
    ("To obtain the detailed case information of the R vs Adams legal case, you can call the `legal_case_fetch` "
     "function with the appropriate parameters. Here's an example of how you can do it:\n\n```json\n{\n  \"name\": "
     "\"legal_case_fetch\",\n  \"arguments\": {\n    \"case_id\": \"R_vs_Adams\",\n    \"details\": true\n  }\n}",
     ["legal_case_fetch", "lawyer_search"]),
    # parallel_156: BFCL's dotted name, though the tool was offered as random_forest_train
    ('```json\n{\n  "name": "random_forest.train",\n  "arguments": {\n    "n_estimators": 100,\n'
     '    "max_depth": 10,\n    "data": "data_random_forest"\n  }\n}\n```', ["random_forest_train"]),
    # parallel_52: a name the model made up
    ('```json\n{\n  "name": "Italian Restaurant Near Me in New York",\n  "arguments": {\n    "location": '
     '"New York",\n    "cuisine": "Italian"\n  }\n}\n```', ["restaurant_finder"]),
])
def test_what_is_not_a_call_to_an_offered_tool_stays_text(text, names):
    assert read(text, names) == (text, [])
