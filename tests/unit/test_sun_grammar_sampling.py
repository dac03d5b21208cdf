"""Sampled SUN rows under a grammar have exactly the constrained distribution (issue 45).

A 5-token table model split the SUN way -- token 0 from the "specialist" table's row of the
prompt (the prefill worker), the rest from the base table's rows (the shared decoder) -- under the
small Lark grammar of harness/grammars.py. Requests go through a real PrefillWorker and ONE
SharedDecoder, rounds of eight at once: half with the grammar, half without, so every decoder step
mixes them. Pearson's chi-square at alpha = 1e-4 against the distributions enumerated exactly
(harness/goodness_of_fit.py): the grammar rows against the constrained split distribution, the free
rows against the unconstrained one (the end token is then an ordinary token). A negative control,
a decoder that forgets the grammar after token 0, must fail the very same test.
"""
from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("llguidance")

import edge.sun.decoder as decoder_module  # noqa: E402
from edge.model import kv_blob  # noqa: E402
from edge.speculative.sampling import SamplingParams, pick  # noqa: E402
from edge.sun.decoder import SharedDecoder  # noqa: E402
from edge.sun.prefill import PrefillWorker  # noqa: E402
from edge.sun.token_rules import RowRules, SunGrammars  # noqa: E402
from harness.goodness_of_fit import TableEngine, chi_square, critical_value, exact_distribution  # noqa: E402
from harness.grammars import constrained_distribution, tiny_grammar  # noqa: E402

PROMPT = [1, 3, 0]
LENGTH = 4                   # answer tokens at most, token 0 and the end token included
HOT = SamplingParams(temperature=1.0)
ROUND = 8                    # requests decoded together: half under the grammar


class SplitTable(TableEngine):
    """The table model as a SUN engine: its "KV" is the token context, carried in the blob's header."""

    def __init__(self, seed):
        super().__init__(vocab=5, seed=seed)
        self.fingerprint = "split-table"

    def export_kv(self, seq, dtype="float16", meta=None):
        ctx = self.tokens(seq)
        return kv_blob.encode(np.zeros((1, 2, 1, len(ctx), 1)), self.fingerprint, "float32", tokens=ctx, meta=meta)

    def import_kv(self, blob):
        _, head = kv_blob.decode(blob, fingerprint=self.fingerprint)
        seq = self.new_sequence()
        self._seqs[seq] = list(head["tokens"])
        return seq


class SplitView:
    """The split generation's rows as one model (what the reference enumerates): the prompt's row
    from the specialist, every later row from the base."""

    def __init__(self, spec, base):
        self.spec, self.base, self.vocab_size = spec, base, base.vocab_size

    def row(self, ctx):
        return (self.spec if len(ctx) == len(PROMPT) else self.base).row(ctx)


def sample(n_rounds, seed0=50_000):
    """Counts of (tokens, end token or None) for the grammar rows and of token tuples for the free rows."""
    g = tiny_grammar()
    grammars = SunGrammars(llg=g.tokenizer)
    spec, base = SplitTable(seed=2), SplitTable(seed=1)
    worker = PrefillWorker(spec, "t", kv_dtype="float32", grammars=grammars)
    dec = SharedDecoder(base, max_batch=ROUND, grammars=grammars)
    constrained, free = {}, {}
    for r in range(n_rounds):
        rids = []
        for i in range(ROUND):
            params = SamplingParams(temperature=1.0, seed=seed0 + r * ROUND + i)
            text = g.text if i % 2 == 0 else ""
            rules = RowRules.of(grammars.compile(text) if text else None, None)
            out = worker.prefill(PROMPT, f"r{r}-{i}", params=params, rules=rules)
            dec.admit(out.blob, out.request_id, max_new=LENGTH, params=params, grammar=text, stop_ids=())
            rids.append((out.request_id, bool(text)))
        dec.step()
        assert len(dec.batches[-1]) == ROUND                # the round's rows, with and without, in one step
        dec.run()
        for rid, under in rids:
            toks = dec.pop_result(rid).tokens
            if under:
                stop = toks[-1] if toks[-1] in g.stop_ids else None
                key = (tuple(toks[:-1]) if stop is not None else tuple(toks), stop)
                constrained[key] = constrained.get(key, 0) + 1
            else:
                free[tuple(toks)] = free.get(tuple(toks), 0) + 1
    view = SplitView(spec, base)
    return (constrained, constrained_distribution(view, PROMPT, LENGTH, HOT, g),
            free, exact_distribution(view, PROMPT, LENGTH, HOT))


def test_grammar_rows_and_free_rows_in_one_batch_have_their_exact_distributions():
    constrained, want_c, free, want_f = sample(1500)                    # 6000 rows of each
    for counts, want in ((constrained, want_c), (free, want_f)):
        stat, df = chi_square(counts, want, sum(counts.values()))
        assert df >= 10 and stat < critical_value(df), f"chi2={stat:.1f} >= {critical_value(df):.1f} (df={df})"


def test_negative_control_a_decoder_that_forgets_the_grammar_fails(monkeypatch):
    def unmasked(row, params, rng, rules):                  # the decoder's rows drawn as if unconstrained
        return pick(row, params, rng)[0], None
    monkeypatch.setattr(decoder_module, "choose", unmasked)
    with pytest.raises(AssertionError):                     # an ungrammatical output, or the chi-square
        constrained, want_c, _, _ = sample(400)
        stat, df = chi_square(constrained, want_c, sum(constrained.values()))
        assert stat < critical_value(df)
