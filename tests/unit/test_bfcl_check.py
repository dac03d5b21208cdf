"""benchmarks/lib/bfcl_check.py on real BFCL cases (bfcl-eval's data): the tools sent, and BFCL's own
AST check of the returned calls (names, required and unknown parameters, types, allowed values, order,
an optional string sent empty)."""
import json

import pytest

pytest.importorskip("bfcl_eval", reason="bfcl-eval is not installed")

from benchmarks.lib.bfcl_check import calls_of, check_case, load_category, standardize, to_openai_tools  # noqa: E402


def case(category, case_id):
    return next(c for c in load_category(category) if c["id"] == case_id)


def reply(*calls):
    """An OpenAI response message carrying these (name, arguments) tool calls."""
    return {"role": "assistant", "content": None, "tool_calls": [
        {"id": f"call_{i}", "type": "function",
         "function": {"name": n, "arguments": a if isinstance(a, str) else json.dumps(a)}}
        for i, (n, a) in enumerate(calls)]}


def verdict(c, message):
    calls, why = calls_of(message, c["functions"])
    return why if why else check_case(calls, c["functions"], c["ground_truth"], c["id"].split("_")[0])


def test_categories_load_evenly_spaced_with_their_answers():
    simple = load_category("simple", 10)
    assert [c["id"] for c in simple[:3]] == ["simple_python_0", "simple_python_40", "simple_python_80"]
    assert len(load_category("multiple")) == 200 and len(load_category("parallel", 100)) == 100
    assert all(c["ground_truth"] and c["functions"] and c["messages"][0]["role"] == "user" for c in simple)


def test_bfcl_types_become_json_schema_and_dotted_names_valid():
    tools = to_openai_tools(case("simple", "simple_python_83")["functions"])
    params = tools[0]["function"]["parameters"]
    assert params["type"] == "object"
    assert params["properties"]["coord1"] == {"type": "array", "description": "The first coordinate as "
                                              "(latitude, longitude).", "items": {"type": "number"}}
    forest = to_openai_tools(case("simple", "simple_python_109")["functions"])[0]["function"]
    assert forest["name"] == "random_forest_train" and "type" not in forest["parameters"]["properties"]["data"]
    nested = to_openai_tools(case("simple", "simple_python_89")["functions"])[0]["function"]["parameters"]
    assert nested["properties"]["conditions"]["type"] == "object"


def test_a_simple_call_matches_on_values_types_and_optional_parameters():
    c = case("simple", "simple_python_0")       # calculate_triangle_area(base=10, height=5[, unit="units"])
    name = "calculate_triangle_area"
    assert verdict(c, reply((name, {"base": 10, "height": 5}))) is None
    assert verdict(c, reply((name, {"base": 10, "height": 5, "unit": "Units"}))) is None
    assert "'height': 6" in verdict(c, reply((name, {"base": 10, "height": 6})))
    assert "Expected type integer, got float" in verdict(c, reply((name, {"base": 10.0, "height": 5})))
    assert "Missing required parameter: 'height'" in verdict(c, reply((name, {"base": 10})))
    assert "Unexpected parameter: 'colour'" in verdict(c, reply((name, {"base": 10, "height": 5, "colour": "red"})))
    assert "not a JSON object" in verdict(c, reply((name, "{base: 10")))
    assert verdict(c, {"role": "assistant", "content": "The area is 25."}) == "no tool calls in the reply"
    assert "2 calls, expected 1" in verdict(c, reply((name, {"base": 10, "height": 5}), (name, {"base": 10, "height": 5})))


def test_dotted_names_tuples_and_nested_dicts():
    c = case("simple", "simple_python_83")      # coord tuples of floats, unit "miles"
    ok = {"coord1": [33.4484, -112.074], "coord2": [34.0522, -118.2437], "unit": "miles"}
    assert verdict(c, reply(("calculate_distance", ok))) is None
    assert verdict(c, reply(("calculate_distance", {**ok, "coord1": [33.4484, 112.074]}))) is not None
    forest = case("simple", "simple_python_109")
    assert verdict(forest, reply(("random_forest_train", {"n_estimators": 100, "max_depth": 5,
                                                          "data": "my_data"}))) is None
    db = case("simple", "simple_python_89")     # conditions: {department: Science, school: Bluebird HS|...}
    call = {"database_name": "StudentDB", "table_name": "students",
            "conditions": {"department": "science", "school": "Bluebird HS"}}
    assert verdict(db, reply(("db_fetch_records", call))) is None
    bad = {**call, "conditions": {"department": "Science", "school": "Redwood"}}
    assert "dict_value" in verdict(db, reply(("db_fetch_records", bad)))


def test_an_optional_string_sent_empty_is_left_out_as_bfcl_judges_it():
    m = case("multiple", "multiple_38")         # library.search_book: genre optional ("" allowed)
    ask = {"book_name": "The Alchemist", "city": "New York", "availability": False}
    assert verdict(m, reply(("library_search_book", {**ask, "genre": ""}))) is None
    assert verdict(m, reply(("library_search_book", ask))) is None
    assert "genre" in verdict(m, reply(("library_search_book", {**ask, "genre": "Fiction"})))


def test_multiple_needs_the_right_function_and_parallel_any_order():
    m = case("multiple", "multiple_0")          # triangle_properties.get(5, 4, 3) among circle_properties.get
    sides = {"side1": 5, "side2": 4, "side3": 3}
    assert verdict(m, reply(("triangle_properties_get", {**sides, "get_area": True}))) is None
    assert "'triangle_properties.get' not found" in verdict(m, reply(("circle_properties_get", {"radius": 5.0})))
    p = case("parallel", "parallel_0")          # spotify.play: Taylor Swift 20, Maroon 5 15
    swift, maroon = {"artist": "Taylor Swift", "duration": 20}, {"artist": "Maroon 5", "duration": 15}
    assert verdict(p, reply(("spotify_play", maroon), ("spotify_play", swift))) is None
    assert "1 calls, expected 2" in verdict(p, reply(("spotify_play", swift)))
    assert "cannot_find_match" in verdict(p, reply(("spotify_play", swift), ("spotify_play", swift)))


def test_standardize_is_bfcls():
    assert standardize("New York, NY") == standardize("new_york-ny") == "newyorkny"
