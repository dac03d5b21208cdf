"""split_generate (the reference semantics of SUN inference) against a plain one-prompt loop.

Rows that hit a stop token leave the batch; the rest must continue exactly as if
each prompt had been decoded alone (float64, greedy: token for token)."""
import torch

from edge.model.sun_modules import split_generate
from harness.tiny_models import random_model, specialist


def alone(prefill, decoder, prompt, max_new, stops=()):
    logits, kv = prefill(torch.tensor([prompt]))
    out = [int(logits[0, -1].argmax())]
    while len(out) < max_new and out[-1] not in stops:
        logits, kv = decoder(torch.tensor([[out[-1]]]), past=kv)
        out.append(int(logits[0, -1].argmax()))
    return out


def test_rows_that_stop_leave_the_batch_and_the_rest_decode_as_alone():
    base = random_model(seed=3)
    spec = specialist(base, seed=4)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 256, (n,), generator=g).tolist() for n in (5, 9, 2, 13, 7, 4)]
    free = [alone(spec, base, p, 14) for p in prompts]
    # stop tokens chosen from the free runs so rows end at different steps (one at its first token)
    stops = {free[0][0], free[1][4], free[3][9]}
    want = [alone(spec, base, p, 14, stops) for p in prompts]
    lengths = sorted({len(w) for w in want})
    assert len(lengths) >= 3 and lengths[-1] == 14, want   # the test exercises early and late exits
    for bs in (6, 4, 1):
        assert split_generate(spec, base, prompts, 14, sorted(stops), batch_size=bs) == want


def test_every_row_stopping_at_its_first_token_returns_that_token():
    base = random_model(seed=5)
    prompts = [[5, 6, 7], [8, 9]]
    firsts = [alone(base, base, p, 1)[0] for p in prompts]
    assert split_generate(base, base, prompts, 10, firsts) == [[t] for t in firsts]
