"""A decode step that fails with something other than an EngineError (a bug, memory, a broken library)
ends the requests it could not step with an error, said in the log, instead of leaving them waiting
forever while the loop retries (seen: a SUN request hung on a decoder whose every step raised)."""
import logging

import numpy as np

from edge.runtime.isolated_step import step_isolated


class _Flaky:
    """An engine whose step raises for sequence 2 (alone or in a batch) and works for the others."""
    def step(self, seqs, tokens):
        if 2 in seqs:
            raise AttributeError("'SiblingContext' object has no attribute 'x'")
        return np.ones((len(seqs), 3)) * np.array(seqs)[:, None]


def test_a_sequence_whose_step_raises_fails_alone_and_is_logged(caplog):
    with caplog.at_level(logging.ERROR, logger="edge.runtime.isolated_step"):
        rows = step_isolated(_Flaky(), [1, 2, 3], [0, 0, 0])
    assert rows[1] is None and rows[0][0] == 1 and rows[2][0] == 3
    assert "AttributeError" in caplog.text and "'SiblingContext' object" in caplog.text


def test_the_sun_decoder_ends_such_a_request_with_an_error():
    """Through SharedDecoder.step: the failing request finishes 'error', its neighbour finishes."""
    import torch
    from edge.engines.torch_engine import TorchEngine
    from edge.model.transformer import Transformer, tiny_config
    from edge.sun.decoder import SharedDecoder
    torch.manual_seed(0)
    engine = TorchEngine(Transformer(tiny_config("llama")).double(), fingerprint="tiny")
    decoder = SharedDecoder(engine, max_batch=4)
    real = engine.step
    bad = set()
    engine.step = lambda seqs, toks: (_ for _ in ()).throw(RuntimeError("broken")) if bad & set(seqs) \
        else real(seqs, toks)
    blobs = []
    for prompt in ([1, 2, 3], [4, 5, 6]):
        s = engine.new_sequence()
        engine.forward(s, prompt)
        blobs.append(engine.export_kv(s))
        engine.free(s)
    decoder.admit(blobs[0], "ok", max_new=4, first_token=7)
    decoder.admit(blobs[1], "bad", max_new=4, first_token=7)
    decoder.step()
    bad.add(decoder._run["bad"].seq)
    decoder.run(max_steps=10)
    assert decoder.results["bad"].finish_reason == "error"
    assert decoder.results["ok"].finish_reason == "length" and len(decoder.results["ok"].tokens) == 4
