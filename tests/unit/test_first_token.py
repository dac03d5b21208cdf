"""The first token comes from the prefill's own row (edge/speculative/generate.py, _Run.take_first_row):
one target call for the whole prompt, none for its last token alone, and the speculative loop
commits the first token before it asks the drafter anything (through the star: no wait on the
hub), still equal to plain greedy decoding (under a grammar: tests/unit/test_jump_forward.py)."""
from edge.speculative.drafter import Drafter
from edge.speculative.generate import ModelDrafter, generate_plain, generate_speculative
from harness.table_engine import TableEngine

PROMPT = [3, 1, 4, 1, 5, 9, 2, 6]


class _Recording(Drafter):
    """A drafter that notes how many tokens were committed each time it is asked."""
    vocab_size = None

    def __init__(self, inner: Drafter, committed: list):
        self.inner, self.committed, self.asked_after = inner, committed, []

    def draft(self, context, gamma, rng):
        self.asked_after.append(len(self.committed))
        return self.inner.draft(context, gamma, rng)

    def prefill(self, prompt) -> bool:
        return False                          # what a remote drafter does: nothing before the rounds


def test_one_call_for_the_prompt_and_its_row_gives_the_first_token():
    target = TableEngine(seed=1, window=2)
    got = generate_plain(target, PROMPT, 10)
    prefill = [t for t in got.timings if t.kind == "prefill"]
    assert [t.n_tokens for t in prefill] == [len(PROMPT)]
    assert got.n_verify_calls == got.n_generated == 10        # the prefill's call yielded the first


def test_the_first_token_is_committed_before_the_drafter_is_asked():
    target = TableEngine(seed=1, window=2)
    want = generate_plain(target, PROMPT, 24).tokens
    committed: list = []
    drafter = _Recording(ModelDrafter(TableEngine(seed=2, window=2)), committed)
    got = generate_speculative(target, drafter, PROMPT, 24, 3, on_token=committed.append)
    assert got.tokens == want
    assert drafter.asked_after and drafter.asked_after[0] == 1

