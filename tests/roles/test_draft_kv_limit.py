"""--max-kv-mb holds for what the draft engine really holds, within a batch too (edge/star/draft_service.py).

The load test saw 8.26 MB of live tokens under an 8 MB limit (each request of a batch was
checked against the KV held before the batch) and 16.8 MB allocated (the torch engine gives a
sequence 64 tokens at once, doubles, and keeps it after a rollback, while the limit counted
live tokens). Counted in the engine's own bytes here: per-token size from the engine."""
from __future__ import annotations

import torch

from edge.engines.torch_engine import TorchEngine
from edge.wire.protocol import E_OVERLOADED, DraftRequest, DraftResponse, Error
from edge.star.draft_service import DraftLimits, DraftService
from harness.tiny_models import tiny_model

torch.set_num_threads(1)
CHUNK = 64                       # tokens a torch sequence is first allocated for (edge/model/kv.py)


def service(chunks: float, ahead: bool = False):
    eng = TorchEngine(tiny_model(1), "draft")
    per = eng.kv_bytes_per_token()
    limit = chunks * CHUNK * per
    svc = DraftService(eng, DraftLimits(max_sessions=16, max_kv_mb=limit / 1e6, ahead=ahead))
    return svc, eng, limit


def replies(svc):
    return dict(svc.step())


def test_one_batch_admits_only_what_fits_and_counts_allocated_bytes():
    svc, eng, limit = service(3.5)            # room for three sequences' first chunk
    for i in range(5):
        svc.open(f"s{i}")
        svc.submit(DraftRequest(f"s{i}", 1, 0, [3 + i, 4, 5, 6], 3))
    out = replies(svc)                        # one batch of five short requests
    ok = [sid for sid, m in out.items() if isinstance(m, DraftResponse)]
    refused = [m for m in out.values() if isinstance(m, Error)]
    assert len(ok) == 3 and len(refused) == 2, out
    assert all(m.code == E_OVERLOADED and "KV memory limit" in m.message for m in refused)
    assert eng.kv_bytes() <= limit                       # 7 live tokens each, 64 allocated
    assert svc.kv_bytes() == eng.kv_bytes() == 3 * CHUNK * eng.kv_bytes_per_token()
    assert svc.stats.counters["refused_kv"] == 2


def test_growth_past_a_chunk_is_checked_and_a_rollback_keeps_the_allocation():
    svc, eng, limit = service(2.5)
    ctx = list(range(3, 3 + 70))                         # past 64 tokens: a 128-token buffer
    svc.open("long")
    svc.submit(DraftRequest("long", 1, 0, ctx, 3))
    assert isinstance(replies(svc)["long"], DraftResponse)
    assert svc.kv_bytes() == eng.kv_bytes() == 2 * CHUNK * eng.kv_bytes_per_token()
    svc.submit(DraftRequest("long", 2, 5, [9], 3))       # cut back to 6 tokens: still 128 held
    assert isinstance(replies(svc)["long"], DraftResponse)
    assert svc.kv_bytes() == eng.kv_bytes() == 2 * CHUNK * eng.kv_bytes_per_token()
    svc.open("short")                                     # half a chunk left: its first is refused
    svc.submit(DraftRequest("short", 1, 0, [3, 4, 5], 2))
    assert isinstance(replies(svc)["short"], Error)
    svc.close("long")
    svc.submit(DraftRequest("short", 2, 0, [3, 4, 5], 2))  # freed at the next step: room again
    assert isinstance(replies(svc)["short"], DraftResponse)
    assert svc.kv_bytes() == eng.kv_bytes() == CHUNK * eng.kv_bytes_per_token()


def test_draft_ahead_stays_within_the_limit():
    """Idle steps extend served chains one token at a time, the recent sessions together; a step
    may not cross into chunks that do not fit (both sessions reach 64 tokens, and only half of
    the two 128-token buffers they would need next is left)."""
    svc, eng, limit = service(3.5, ahead=True)
    for i in range(2):
        svc.open(f"s{i}")
        svc.submit(DraftRequest(f"s{i}", 1, 0, [3 + i] * 60, 3))
    replies(svc)
    for _ in range(40):                                   # draft-ahead until it has nothing to do
        if not svc.has_work():
            break
        svc.step()
        assert eng.kv_bytes() <= limit and svc.kv_bytes() >= eng.kv_bytes()
    assert svc.stats.snapshot()["ahead_tokens"] > 0               # it drafted ahead up to the chunk
    assert eng.kv_bytes() == 2 * CHUNK * eng.kv_bytes_per_token()
