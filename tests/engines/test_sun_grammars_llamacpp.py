"""The shared decoder on llama.cpp masks each row by its own grammar too (issue 45).

A SUN bundle of a tiny base (F32 GGUF and the byte-level BPE it carries: the decoder's grammar
tokenizer comes from the bundle, edge/sun/worker_tokenizer.py) decodes, in ONE llama.cpp batch,
rows under two JSON schemas and rows without a grammar, all prefilled by a torch prefill worker
(the KV blob crosses runtimes). Every grammar row ends on the end token with JSON that validates;
the greedy token is the first of its logprob alternatives, for every row. (That rows without a
grammar are untouched is exact on float64 torch, tests/unit/test_sun_row_grammars.py; llama.cpp's
batched rows are not bit-identical to one alone, so they are not compared here.)
"""
from __future__ import annotations

import json

import pytest

pytest.importorskip("llguidance")
jsonschema = pytest.importorskip("jsonschema")
llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (pip install .[llama])")

from edge.engines.loader import load_engine  # noqa: E402
from edge.engines.torch_engine import TorchEngine  # noqa: E402
from edge.model.sun_modules import load_module  # noqa: E402
from edge.model.tokenizer import Tokenizer  # noqa: E402
from edge.speculative.grammar import grammar_from_json_schema  # noqa: E402
from edge.sun.decoder import SharedDecoder  # noqa: E402
from edge.sun.prefill import PrefillWorker  # noqa: E402
from edge.sun.token_rules import RowRules  # noqa: E402
from edge.sun.worker_tokenizer import worker_grammars  # noqa: E402
from harness.console_scripts import hf_model, sun_dirs  # noqa: E402
from harness.sun_grammars import PERSON, POINT  # noqa: E402

pytestmark = pytest.mark.llamacpp


@pytest.fixture(scope="module")
def bundle(tmp_path_factory):
    from export.bundle import build_bundle
    root = tmp_path_factory.mktemp("sun-gguf-grammars")
    dec_dir, spec_dir = sun_dirs(root)
    tok_dir = hf_model(root / "tiny-hf")
    build_bundle(dec_dir, root / "sun", onnx_graphs=(), gguf_types=("F32",), tokenizer=tok_dir, log=lambda *_: None)
    return root / "sun", dec_dir, spec_dir, Tokenizer.from_hf_dir(tok_dir)


def test_one_llamacpp_batch_of_grammar_rows_and_free_rows(bundle):
    sun, dec_dir, spec_dir, tok = bundle
    engine = load_engine(sun, backend="llamacpp", role="decoder", threads=1, n_seq_max=8)
    grammars = worker_grammars(sun, None, engine.vocab_size)
    assert grammars is not None                                     # the bundle carries its tokenizer
    spec, _ = load_module(spec_dir)
    worker = PrefillWorker(TorchEngine(spec, fingerprint=engine.fingerprint), "t", grammars=grammars)
    dec = SharedDecoder(engine, max_batch=8, stop_ids=tok.eos_ids, grammars=grammars)
    kinds = [PERSON, None, POINT, None, PERSON]
    texts = [grammar_from_json_schema(k) if k else "" for k in kinds]
    try:
        for i, text in enumerate(texts):
            out = worker.prefill(tok.encode(f"row {i} says"), f"r{i}",
                                 rules=RowRules.of(grammars.compile(text) if text else None, 2))
            dec.admit(out.blob, f"r{i}", max_new=96, grammar=text, logprobs=2,
                      on_token=lambda e: e.logprob and assert_top_is(e))
        results = dec.run()
        assert len(dec.batches[0]) == len(kinds)                    # one llama_decode for every row
        for i, kind in enumerate(kinds):
            r = results[f"r{i}"]
            if kind is not None:
                assert r.finish_reason == "stop" and r.tokens[-1] in tok.eos_ids, tok.decode(r.tokens)
                jsonschema.validate(json.loads(tok.decode(r.tokens[:-1])), kind)
    finally:
        engine.close()


def assert_top_is(event):
    lp, alts = event.logprob
    assert alts[0][0] == event.token and alts[0][1] == pytest.approx(lp) and lp <= 0
