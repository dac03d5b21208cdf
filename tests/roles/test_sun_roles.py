"""SUN roles: prefill workers hand KV blobs to one shared decoder that batches all tasks.

Tiny random float64 models keep greedy comparisons exact (no near-tie flips).
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from edge.engines.base import EngineError
from edge.engines.torch_engine import TorchEngine
from edge.sun.decoder import AdmissionError, SharedDecoder
from edge.sun.prefill import PrefillWorker
from edge.model.sun_modules import load_module, split_generate, weights_fingerprint
from export.quant import dequantize_q4, is_quantised_linear, quantize_q4
from export.tune import build_decoder, save_decoder

from harness.tiny_models import random_model, specialist

ROOT = Path(__file__).resolve().parents[2]


def prompts(n, seed=1):
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 256, size=int(rng.integers(2, 12))).tolist() for _ in range(n)]


@pytest.fixture(scope="module")
def setup():
    base = random_model()
    fp = weights_fingerprint(base)
    specs = {t: specialist(base, i + 10) for i, t in enumerate(("maths", "code", "tools"))}
    workers = {t: PrefillWorker(TorchEngine(m, fingerprint=fp), t, kv_dtype="float64") for t, m in specs.items()}
    return base, fp, specs, workers


def test_mixed_tasks_share_one_batched_decoder(setup):
    base, fp, specs, workers = setup
    dec = SharedDecoder(TorchEngine(base, fingerprint=fp), max_batch=16)
    jobs = [(t, p) for t, p in zip(["maths", "code", "tools"] * 3, prompts(9))]
    streamed = {}
    rids = []
    for t, p in jobs:
        out = workers[t].prefill(p)
        assert out.decoder_fingerprint == fp and out.prompt_len == len(p)
        rids.append(dec.admit(out.blob, max_new=7,
                              on_token=lambda ev: streamed.setdefault(ev.request_id, []).append(ev)))
    assert dec.load == 9
    results = dec.run()
    # one batched engine step per token position, not per request: tasks were decoded together
    assert dec.steps == 6 and dec.tokens_out == 9 * 6
    for rid, (t, p) in zip(rids, jobs):
        ref = split_generate(specs[t], base, [p], max_new=7)[0]
        assert results[rid].tokens == ref, t
        assert results[rid].task == t and results[rid].finish_reason == "length"
        evs = streamed[rid]
        assert [e.token for e in evs] == ref[1:] and evs[-1].done and not any(e.done for e in evs[:-1])


def test_continuous_batching_admits_mid_flight_and_stops(setup):
    base, fp, specs, workers = setup
    ps = prompts(3, seed=5)
    ref = [split_generate(specs["code"], base, [p], max_new=8)[0] for p in ps]
    stop = ref[0][3]  # make the first request stop early on its own 4th token
    dec = SharedDecoder(TorchEngine(base, fingerprint=fp), max_batch=2, stop_ids=[stop])
    a = dec.admit(workers["code"].prefill(ps[0]).blob, max_new=8)
    dec.step()
    b = dec.admit(workers["code"].prefill(ps[1]).blob, max_new=8)
    c = dec.admit(workers["code"].prefill(ps[2]).blob, max_new=8)  # waits: max_batch is 2
    res = dec.run()
    assert res[a].tokens == ref[0][: ref[0].index(stop) + 1] and res[a].finish_reason == "stop"
    for rid, r in ((b, ref[1]), (c, ref[2])):
        cut = r.index(stop) + 1 if stop in r else len(r)
        assert res[rid].tokens == r[:cut]


def test_refuses_bad_blobs_and_keeps_serving(setup):
    base, fp, specs, workers = setup
    dec = SharedDecoder(TorchEngine(base, fingerprint=fp))
    p = prompts(1, seed=9)[0]
    good = dec.admit(workers["tools"].prefill(p).blob, max_new=6)
    dec.step()
    blob = workers["tools"].prefill(p).blob
    other = PrefillWorker(TorchEngine(specs["maths"], fingerprint="f" * 64), "maths").prefill(p).blob
    shaped = random_model(num_layers=3)
    misshaped = PrefillWorker(TorchEngine(shaped, fingerprint=fp), "x").prefill(p).blob
    cases = {
        "other decoder": (other, "cannot be admitted"),
        "truncated": (blob[:-7], "truncated"),
        "header cut": (blob[:12], "truncated"),
        "shapes": (misshaped, "shape mismatch"),
        "garbage": (b"not a blob at all", "bad magic"),
    }
    for name, (bad, msg) in cases.items():
        with pytest.raises(AdmissionError, match=msg):
            dec.admit(bad, max_new=6)
    assert dec.refused == len(cases) and dec.load == 1
    res = dec.run()
    assert res[good].tokens == split_generate(specs["tools"], base, [p], max_new=6)[0]


def test_fp_and_int4_decoders_have_distinct_fingerprints(setup):
    base = random_model(seed=3).float()
    dec, fp = build_decoder(base, "fp32")
    qdec, qfp = build_decoder(base, "int4")
    assert fp != qfp and fp == weights_fingerprint(base)
    # the QSUN decoder computes with exactly the packed int4 grid's values
    for name, w in base.state_dict().items():
        got = qdec.state_dict()[name]
        if is_quantised_linear(name):
            assert torch.equal(got, dequantize_q4(quantize_q4(w))), name
        else:
            assert torch.equal(got, w), name
    blob = PrefillWorker(TorchEngine(base, fingerprint=fp), "t").prefill([1, 2, 3]).blob
    with pytest.raises(AdmissionError, match="cannot be admitted"):
        SharedDecoder(TorchEngine(qdec, fingerprint=qfp)).admit(blob)


def test_kv_blob_crosses_processes(setup, tmp_path):
    base, fp, specs, workers = setup
    save_decoder(tmp_path / "dec", base, "fp32", fp)
    loaded, man = load_module(tmp_path / "dec", dtype=torch.float64)
    assert weights_fingerprint(loaded, "fp32") == fp == man["fingerprint"]
    files, expect = [], []
    for i, (t, p) in enumerate(zip(["maths", "code"], prompts(2, seed=11))):
        out = workers[t].prefill(p)
        f = tmp_path / f"req{i}.kv"
        f.write_bytes(out.blob)
        files.append(str(f))
        d = SharedDecoder(TorchEngine(base, fingerprint=fp))
        rid = d.admit(out.blob, max_new=8)
        expect.append(d.run()[rid].tokens)
    cmd = [sys.executable, "-m", "edge.sun.decoder", str(tmp_path / "dec"), "--max-new", "8"]
    for f in files:
        cmd += ["--blob", f]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=ROOT, env=env)
    assert proc.returncode == 0, proc.stderr
    lines = [json.loads(line) for line in proc.stdout.splitlines()]
    assert [line["tokens"] for line in lines] == expect
    assert [line["task"] for line in lines] == ["maths", "code"]


def test_full_context_finishes_only_that_sequence(setup):
    base, fp, specs, workers = setup
    dec = SharedDecoder(TorchEngine(base, fingerprint=fp, max_len=12))
    long_p, short_p = list(range(3, 13)), [5, 6, 7]
    a = dec.admit(workers["maths"].prefill(long_p).blob, max_new=8)
    b = dec.admit(workers["maths"].prefill(short_p).blob, max_new=5)
    res = dec.run()
    assert res[a].finish_reason == "context" and len(res[a].tokens) == 3  # 10 prompt + 2 fed = 12
    assert res[b].finish_reason == "length"
    assert res[b].tokens == split_generate(specs["maths"], base, [short_p], max_new=5)[0]


class RefusesLongSequences(TorchEngine):
    """A step with a sequence past ROOM tokens fails for the whole batch (a llama.cpp slot running out)."""
    ROOM = 12

    def step(self, seqs, tokens):
        if any(self.length(s) + 1 > self.ROOM for s in seqs):
            raise EngineError("llama_decode failed (code 1: no KV slot: context full)")
        return super().step(seqs, tokens)


def test_a_sequence_the_engine_refuses_ends_alone_and_cancel_frees_its_slot(setup):
    base, fp, specs, workers = setup
    engine = RefusesLongSequences(base, fingerprint=fp)
    dec = SharedDecoder(engine)
    long_p, short_p = list(range(3, 13)), [5, 6, 7]
    a = dec.admit(workers["maths"].prefill(long_p).blob, max_new=8)
    b = dec.admit(workers["maths"].prefill(short_p).blob, max_new=5)
    c = dec.admit(workers["code"].prefill(short_p).blob, max_new=5)
    assert dec.cancel(c) and not dec.cancel(c) and engine.active_sequences == 2
    res = dec.run()
    assert res[a].finish_reason == "error" and len(res[a].tokens) == 3     # 10 prompt + 2 fed = 12
    assert res[b].finish_reason == "length" and c not in res
    assert res[b].tokens == split_generate(specs["maths"], base, [short_p], max_new=5)[0]
    assert engine.active_sequences == 0


def test_a_decoder_with_fixed_slots_queues_the_rest_and_refuses_bad_blobs_at_once(setup):
    """An engine with `capacity` (llama.cpp's sequence slots) runs that many; the other admitted
    blobs wait, already validated, and give the same tokens as an unlimited decoder."""
    base, fp, specs, workers = setup
    ps = prompts(4, seed=9)
    blobs = [workers["code"].prefill(p, request_id=f"r{i}").blob for i, p in enumerate(ps)]
    engine = TorchEngine(base, fingerprint=fp)
    engine.capacity = 2
    dec = SharedDecoder(engine, max_batch=8)
    for i, b in enumerate(blobs):
        dec.admit(b, max_new=6)
    assert dec.stats_snapshot()["running"] == 2 and dec.stats_snapshot()["waiting"] == 2
    with pytest.raises(AdmissionError, match="truncated"):
        dec.admit(blobs[0][:-9], request_id="bad", max_new=6)      # refused now, not when a slot frees
    res = dec.run()
    assert [res[f"r{i}"].tokens for i in range(4)] == [split_generate(specs["code"], base, [p], 6)[0] for p in ps]
