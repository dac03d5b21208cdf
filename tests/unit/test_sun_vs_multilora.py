"""The pure parts of benchmarks/sun/sun_vs_multilora.py (benchmarks/lib/multilora_plan.py): the Zipf
burst, llama-server's per-request `lora` field, a cell's summary and the table."""
import pytest

from benchmarks.lib.multilora_plan import burst, cell_key, lora_field, summarize, table, zipf_tasks


def test_the_zipf_burst_is_seeded_skewed_and_cycles_the_items():
    a, b = zipf_tasks(64, 2000, seed=3), zipf_tasks(64, 2000, seed=3)
    assert a == b and a != zipf_tasks(64, 2000, seed=4)
    assert all(0 <= t < 64 for t in a)
    counts = [a.count(t) for t in range(64)]
    assert counts[0] > 3 * counts[7] > 0 and counts[0] == max(counts)      # Zipf(1.1): task 0 the most asked
    reqs = burst(8, 10, n_items=4, seed=1)
    assert [r["request"] for r in reqs] == list(range(10))
    assert [r["item"] for r in reqs] == [0, 1, 2, 3, 0, 1, 2, 3, 0, 1]
    assert [r["task"] for r in reqs] == zipf_tasks(8, 10, seed=1)
    with pytest.raises(ValueError):
        burst(8, 10, n_items=0)
    with pytest.raises(ValueError):
        zipf_tasks(0, 3)


def test_the_lora_field_names_every_adapter_with_an_explicit_scale():
    assert lora_field(2, 4) == [{"id": 0, "scale": 0.0}, {"id": 1, "scale": 0.0},
                                {"id": 2, "scale": 1.0}, {"id": 3, "scale": 0.0}]
    assert lora_field(None, 3) == [{"id": i, "scale": 0.0} for i in range(3)]   # the bare base: never []
    assert lora_field(0, 1, scale=0.5) == [{"id": 0, "scale": 0.5}]
    with pytest.raises(ValueError, match="outside the 4 loaded adapters"):
        lora_field(4, 4)


def _rows(ttfts, toks, correct):
    return [{"status": 200, "ttft_s": t, "completion_tokens": n, "correct": c} for t, n, c in zip(ttfts, toks, correct)]


def test_a_cell_summary_and_the_table():
    rows = _rows([1.0, 2.0, 3.0, 4.0], [10, 20, 30, 40], [True, False, True, True]) + [{"status": 503}]
    s = summarize(rows, wall_s=10.0)
    assert s["ok"] == 4 and s["requests"] == 5 and s["completion_tokens"] == 100 and s["tok_s"] == 10.0
    assert s["ttft_p50_s"] == 2.5 and s["ttft_p99_s"] == pytest.approx(3.97)
    assert s["accuracy"] == 0.75 and s["scored"] == 4
    mem = {"peak_rss_sum": 800 * 2**20, "peak_pss_sum": 700 * 2**20, "cpu_s": 20.0}
    sun = {"side": "sun", "adapters": "sun-lora", "n_tasks": 8, "summary": summarize(rows, 5.0), "memory": mem}
    peer = {"side": "llama-server", "adapters": "sun-lora", "n_tasks": 8, "summary": s, "memory": mem}
    pending = {"side": "sun", "adapters": "sun-lora", "n_tasks": 64}               # not run yet: no row
    cells = {cell_key("sun", "sun-lora", 8): sun, cell_key("llama-server", "sun-lora", 8): peer,
             cell_key("sun", "sun-lora", 64): pending}
    lines = table(cells)
    assert len(lines) == 4 and lines[0].startswith("| tasks | side |")
    assert "| 8 | llama-server | sun-lora | 4/5 | 10.0 | 5.0 | 2.50 s |" in lines[2]
    assert lines[3].startswith("| 8 | sun | sun-lora | 4/5 | 20.0 |") and lines[3].endswith("| 0.750 (4) | 2.00x |")
    assert "| 800 | 700 |" in lines[3]


def test_the_code_workload_scores_a_whole_function_or_a_body_and_refuses_a_wrong_one():
    from benchmarks.lib.multilora_workloads import DEFAULT_MAX_TOKENS, correct, items_of
    items = items_of("code", 1500)
    assert len(items) > 100 and DEFAULT_MAX_TOKENS["code"] > DEFAULT_MAX_TOKENS["bfcl"]
    it = items[0]
    p = it["problem"]
    assert p["prompt"] in it["prompt"] and it["prompt"].startswith("Complete the following Python function")
    assert correct(it, "Sure:\n```python\n" + p["prompt"] + p["canonical_solution"] + "```\nDone.")
    assert correct(it, "```python\n" + p["canonical_solution"] + "```")          # a body, as HumanEval scores it
    assert not correct(it, f"```python\ndef {p['entry_point']}(*a):\n    return None\n```")
