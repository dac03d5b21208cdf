"""A draft Engine as a Drafter: the local speculative loop's (edge/speculative/generate.py) and the
agent's own draft. It keeps its sequence in step with the committed tokens."""
from __future__ import annotations

import time
from typing import List, Optional, Sequence, Tuple, Union

import numpy as np

from edge.engines.base import Engine
from edge.speculative.common_prefix import common_prefix
from edge.speculative.constrained import ConstrainedProposer
from edge.speculative.drafter import Drafter
from edge.speculative.jump_forward import FORCED_EXTRA
from edge.speculative.sampling import GREEDY, SamplingParams, SparseDist, pick


class ModelDrafter(Drafter):
    """A draft Engine kept in step with the committed tokens.

    Each call truncates the draft's sequence to its common prefix with the
    context, feeds what is missing and drafts gamma tokens, returning with
    each the exact distribution it was sampled from. With top_k > 0 (and
    temperature > 0) it samples from the renormalised top-k truncation and
    returns that SparseDist — still exactly lossless (docs/architecture.md).
    """

    def __init__(self, engine: Engine, params: SamplingParams = GREEDY, top_k: int = 0):
        if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 0:
            raise ValueError(f"draft top_k must be an integer >= 0 (0 = full distribution), got {top_k!r}")
        self.engine = engine
        self.params = params
        self.top_k = top_k
        self.vocab_size = engine.vocab_size
        self.name = f"model:{engine.fingerprint or engine.name}"
        self._seq: Optional[int] = None
        self._fed: List[int] = []
        self._proposer: Optional[ConstrainedProposer] = None   # the grammar its proposals follow

    def constrain(self, grammar, start: int) -> None:
        """Propose under `grammar` (edge/speculative/constrained.py) from context position `start` on."""
        self._proposer = None if grammar is None else ConstrainedProposer(grammar, start)

    def _pick(self, logits: np.ndarray, rng: np.random.Generator) -> Tuple[int, Union[np.ndarray, SparseDist]]:
        x, q = pick(logits, self.params, rng, self.top_k)
        return x, (SparseDist.one_hot(x) if q is None else q)

    def _sync(self, tokens: List[int]) -> np.ndarray:
        """Make the draft's sequence hold exactly `tokens` (keeping the common
        prefix, refeeding at least one token); the logits after the last one."""
        eng = self.engine
        if self._seq is None:
            self._seq = eng.new_sequence()
            self._fed = []
        keep = min(common_prefix(self._fed, tokens), len(tokens) - 1)
        keep -= eng.prefill_refeed(keep, len(tokens) - keep)     # one tiled call where it pays
        if eng.length(self._seq) != keep:
            eng.truncate(self._seq, keep)
        self._fed = self._fed[:keep]          # stays true even if forward fails
        logits = eng.forward_last(self._seq, tokens[keep:])[-1]
        self._fed = list(tokens)
        return logits

    def draft(self, context: Sequence[int], gamma: int,
              rng: np.random.Generator) -> Tuple[List[int], list]:
        eng = self.engine
        context = [int(t) for t in context]
        # A draft with a shorter context drafts less, or nothing: speculation
        # never decides correctness, the target just decodes alone.
        limit = min(gamma + FORCED_EXTRA, eng.max_len - len(context) + 1)   # forced ones included
        gamma = min(gamma, limit)
        if gamma <= 0 or not context:
            return [], []
        logits = self._sync(context)
        grammar = self._proposer
        if grammar is not None and not grammar.begin(context):
            return [], []
        tokens, qs, free = [], [], 0
        try:
            while free < gamma and len(tokens) < limit:
                if grammar is not None:          # q is then the masked, renormalised q
                    logits = grammar.mask(logits)
                x, q = self._pick(logits, rng)
                tokens.append(x)
                qs.append(q)
                free += 1
                if grammar is not None and not grammar.advance(x):
                    break                        # the grammar ended here: nothing follows
                # the stretch the grammar forces next: proposed as it is, fed with x in one call
                run = grammar.forced(limit - len(tokens)) if grammar is not None else []
                tokens += run
                qs += [SparseDist.one_hot(t) for t in run]
                if free < gamma and len(tokens) < limit:
                    logits = eng.forward(self._seq, [x] + run)[-1]
                    self._fed += [x] + run
        finally:
            if grammar is not None:
                grammar.end()
        return tokens, qs

    def probe_step_seconds(self, token: int) -> float:
        """Seconds of one draft step, measured on a scratch sequence (the second of two calls:
        the first pays one-off costs). A draft-cost sample that needs no prefill."""
        eng = self.engine
        secs = 0.0
        for _ in range(2):
            seq = eng.new_sequence()
            try:
                t = time.perf_counter()
                eng.forward_last(seq, [int(token)])
                secs = time.perf_counter() - t
            finally:
                eng.free(seq)
        return secs

    def prefill(self, prompt: Sequence[int]) -> bool:
        """Feed all but the last prompt token (what draft() would feed anyway)."""
        prompt = [int(t) for t in prompt]
        if 1 < len(prompt) <= self.engine.max_len:
            self._sync(prompt[:-1])
            return True
        return False

    def close(self) -> None:
        """Free the draft's sequence (a later draft() starts a fresh one)."""
        if self._seq is not None:
            self.engine.free(self._seq)
        self._seq, self._fed = None, []
