"""benchmarks/lib/sun_prefill_counts.py: the prefills of a SUN cell, read from its processes' logs."""
from benchmarks.lib.sun_prefill_counts import prefill_counts, prefill_lines

HUB = """02:52:05 sessions=0 joins=0 refused=0 sun_workers=2 sun_routed=17
2026-12-07 02:52:06,246 server.sun_router INFO sun: hub/0b8a sent again by its client: its assignment and job goes again
2026-12-07 02:52:44,788 edge.sun.client INFO sun client hub: request t13 heard nothing after 2 copies: sent again as 8cb3
02:52:46 sessions=0 joins=0 refused=0 sun_workers=2 sun_routed=18
"""
PREFILL = "prefill worker for tasks t0, t1\nprefill-lora: {'jobs': 18, 'failed': 0, 'overloaded': 0}\n"


def test_a_cells_prefills_are_counted_from_its_logs(tmp_path):
    assert prefill_counts(tmp_path) == {"jobs": None, "routed": None, "new_ids": 0, "redelivered": 0}
    (tmp_path / "hub.err").write_text(HUB)
    (tmp_path / "prefill.err").write_text(PREFILL)
    p = prefill_counts(tmp_path)
    assert p == {"jobs": 18, "routed": 18, "new_ids": 1, "redelivered": 1}
    cells = {"sun/sun-lora/64": {"prefills": p, "summary": {"requests": 16}},
             "llama-server/sun-lora/64": {"summary": {"requests": 16}},
             "sun/sun-lora/8": {"prefills": {"jobs": None}, "summary": {"requests": 16}}}
    assert prefill_lines(cells) == ["* sun/sun-lora/64: 18 prefills for 17 requests (16 + the warm-up): 1.06 per "
                                    "request; routed 18, sent again under a new id 1, copies passed on to the "
                                    "workers 1"]
