"""Each row of the shared decoder's batched step follows its own request's grammar (issue 45).

One SharedDecoder batches rows of two JSON schemas, json_object and no grammar at all, whatever
their task, in the same engine steps. Every grammar row equals the reference masked split
generation computed row by row on bare engines (harness/sun_grammars.py: float64, exact) and
validates; every row without a grammar equals the same request decoded alone and the plain split
generation. logprobs come from the masked rows: the reference's own entries, most likely first,
only allowed tokens. Sampled rows under a grammar validate too. A worker without a tokenizer, and
a token 0 that breaks the grammar, are refused with the reason.
"""
import json
import pathlib

import numpy as np
import pytest

pytest.importorskip("llguidance")
jsonschema = pytest.importorskip("jsonschema")

import torch  # noqa: E402

from edge.engines.torch_engine import TorchEngine  # noqa: E402
from edge.model.sun_modules import split_generate  # noqa: E402
from edge.speculative.grammar import JSON_OBJECT, grammar_from_json_schema  # noqa: E402
from edge.speculative.sampling import SamplingParams  # noqa: E402
from edge.sun.decoder import AdmissionError, SharedDecoder  # noqa: E402
from edge.sun.prefill import PrefillWorker  # noqa: E402
from edge.sun.token_rules import GrammarRefused, RowRules, SunGrammars  # noqa: E402
from harness.grammars import bpe_tokenizer  # noqa: E402
from harness.sun_grammars import PERSON, POINT, reference, sun_base  # noqa: E402

torch.set_num_threads(1)
MAX_NEW = 96


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    tok = bpe_tokenizer(pathlib.Path(tmp_path_factory.mktemp("tok")) / "t")
    base, fp, spec = sun_base(tok.vocab_size)
    grammars = SunGrammars(tok)
    texts = {"person": grammar_from_json_schema(PERSON), "point": grammar_from_json_schema(POINT),
             "object": grammar_from_json_schema(JSON_OBJECT)}
    return tok, base, fp, spec, grammars, texts


def prefill(setup, prompt, rid, grammar="", logprobs=None, params=SamplingParams()):
    tok, base, fp, spec, grammars, _ = setup
    worker = PrefillWorker(TorchEngine(spec, fingerprint=fp), "t", kv_dtype="float64", grammars=grammars)
    rules = RowRules.of(grammars.compile(grammar) if grammar else None, logprobs)
    return worker.prefill(prompt, rid, params=params, rules=rules)


def decoder(setup, **kw):
    tok, base, fp, *_ = setup
    return SharedDecoder(TorchEngine(base, fingerprint=fp), max_batch=16, stop_ids=tok.eos_ids,
                         grammars=setup[4], **kw)


def decode(dec, outs, grammars, logprobs=None):
    entries = {o.request_id: [o.logprob] for o in outs}
    for o in outs:
        dec.admit(o.blob, o.request_id, max_new=MAX_NEW, grammar=grammars.get(o.request_id, ""), logprobs=logprobs,
                  on_token=lambda e: entries[e.request_id].append(e.logprob) if e.logprob else None)
    return dec.run(), entries


def test_mixed_grammars_and_none_in_one_batch(setup):
    tok, base, fp, spec, grammars, texts = setup
    kinds = ["person", None, "point", "object", None, "person"]
    prompts = [tok.encode(f"request {i}: answer") for i in range(len(kinds))]
    asked = {f"r{i}": texts[k] for i, k in enumerate(kinds) if k}
    outs = [prefill(setup, p, f"r{i}", asked.get(f"r{i}", "")) for i, p in enumerate(prompts)]
    dec = decoder(setup)
    results, _ = decode(dec, outs, asked)
    assert dec.batches[0] == ("t",) * len(kinds) and dec.stats_snapshot()["batch_mean"] > 2   # one batch
    for i, (kind, p) in enumerate(zip(kinds, prompts)):
        r = results[f"r{i}"]
        g = grammars.compile(texts[kind]) if kind else None
        want, _ = reference(spec, base, p, g, MAX_NEW, tok.eos_ids)
        assert r.tokens == want, (kind, r.tokens, want)
        if kind is None:                                       # untouched: as decoded alone, as split_generate
            alone = decoder(setup)
            assert decode(alone, [prefill(setup, p, "alone")], {})[0]["alone"].tokens == r.tokens
            assert split_generate(spec, base, [p], MAX_NEW, tuple(tok.eos_ids))[0] == r.tokens
            continue
        assert r.finish_reason == "stop" and r.tokens[-1] in tok.eos_ids
        answer = json.loads(tok.decode(r.tokens[:-1]))
        jsonschema.validate(answer, {"person": PERSON, "point": POINT, "object": JSON_OBJECT}[kind])


def test_logprobs_are_the_masked_rows(setup):
    tok, base, fp, spec, grammars, texts = setup
    p = tok.encode("logprobs please")
    outs = [prefill(setup, p, "g", texts["person"], logprobs=4), prefill(setup, p, "free", logprobs=4)]
    results, entries = decode(decoder(setup), outs, {"g": texts["person"]}, logprobs=4)
    for rid, g in (("g", grammars.compile(texts["person"])), ("free", None)):
        want, want_entries = reference(spec, base, p, g, MAX_NEW, tok.eos_ids, logprobs=4)
        assert results[rid].tokens == want and len(entries[rid]) == len(want)
        for (lp, alts), (wlp, walts), t in zip(entries[rid], want_entries, want):
            assert lp == pytest.approx(wlp, abs=1e-12) and [a for a, _ in alts] == [a for a, _ in walts]
            assert alts[0][0] == t and alts[0][1] == pytest.approx(lp)          # greedy: the top one
            assert [x for _, x in alts] == sorted((x for _, x in alts), reverse=True) and lp <= 0
    # the grammar row's alternatives are tokens it allows: the masked distribution sums to 1
    assert all(len(alts) < 4 for _, alts in entries["g"][1:3])     # {"name": ... is forced, one token each


def test_sampled_rows_follow_their_grammar(setup):
    tok, base, fp, spec, grammars, texts = setup
    params = [SamplingParams(temperature=1.0, seed=s) for s in range(6)]
    kinds = ["person", "point", None, "person", "point", None]
    asked = {f"s{i}": texts[k] for i, k in enumerate(kinds) if k}
    outs = [prefill(setup, tok.encode(f"sample {i}"), f"s{i}", asked.get(f"s{i}", ""), params=sp)
            for i, sp in enumerate(params)]
    dec = decoder(setup)
    for o, sp in zip(outs, params):
        dec.admit(o.blob, o.request_id, max_new=MAX_NEW, params=sp, grammar=asked.get(o.request_id, ""))
    results = dec.run()
    for i, kind in enumerate(kinds):
        if kind:
            r = results[f"s{i}"]
            assert r.finish_reason == "stop"
            jsonschema.validate(json.loads(tok.decode(r.tokens[:-1])), {"person": PERSON, "point": POINT}[kind])


def test_grammars_are_refused_where_they_cannot_be_followed(setup):
    tok, base, fp, spec, grammars, texts = setup
    p = tok.encode("x")
    bare = SharedDecoder(TorchEngine(base, fingerprint=fp), stop_ids=tok.eos_ids)
    out = prefill(setup, p, "a", texts["person"])
    with pytest.raises(AdmissionError, match="follows no grammars.*--tokenizer"):
        bare.admit(out.blob, "a", grammar=texts["person"])
    worker = PrefillWorker(TorchEngine(spec, fingerprint=fp), "t", kv_dtype="float64")
    with pytest.raises(GrammarRefused, match="follows no grammars"):
        worker.submit(p, "b", grammar=texts["person"])
    free = prefill(setup, p, "c")                                  # token 0 drawn without the grammar
    assert free.first_token != out.first_token
    with pytest.raises(AdmissionError, match="breaks its grammar"):
        decoder(setup).admit(free.blob, "c", grammar=texts["person"])
    with pytest.raises(GrammarRefused, match="refused"):
        grammars.compile('{"grammars": [{"lark_grammar": "start: ("}]}')
    assert bare.load == 0 and worker.load == 0


def test_an_adapter_workers_mixed_step_masks_each_rows_token_0(setup, tmp_path):
    """AdapterPrefillWorker: one step over rows of two tasks, with and without a grammar; each
    grammar row's token 0 is the masked argmax of the row its task gives, its entry from that row."""
    from edge.speculative.constrained import mask_logits
    from edge.sun.adapter_prefill import AdapterPrefillWorker
    from edge.sun.adapter_torch import TorchAdapterBackend
    from harness.sun_adapters import trained_adapter
    tok, base, fp, spec, grammars, texts = setup
    choice = grammar_from_json_schema({"enum": ["a", "b", 3, True]})      # several first tokens allowed
    w = AdapterPrefillWorker(TorchAdapterBackend(base, fp), kv_dtype="float64", grammars=grammars)
    for i, t in enumerate(("code", "maths")):
        d, sha = trained_adapter(base, tmp_path, t, seed=i + 1)
        w.add(t, d, sha256=sha)
    jobs = [("code", choice), ("maths", ""), ("maths", choice), ("code", texts["point"])]
    prompts = [tok.encode(f"adapter row {i}") for i in range(len(jobs))]
    for i, ((task, g), p) in enumerate(zip(jobs, prompts)):
        w.submit(p, f"a{i}", task=task, grammar=g, logprobs=2)
    outs = {o.request_id: o for o in w.step()}
    assert len(w.steps) == 1 and len(outs) == len(jobs)
    rows = w.backend.prefill_rows(prompts, [t for t, _ in jobs])
    for i, ((task, g), (logits, _)) in enumerate(zip(jobs, rows)):
        row = mask_logits(logits, grammars.compile(g).matcher().allowed()) if g else logits
        o = outs[f"a{i}"]
        assert o.first_token == int(row.argmax()) and o.logprob[1][0][0] == o.first_token
        assert o.logprob[0] == pytest.approx(float(row[o.first_token] - np.logaddexp.reduce(row)), abs=1e-9)
    assert outs["a0"].first_token != outs["a0"].logprob[1][-1][0]           # a real choice was masked
