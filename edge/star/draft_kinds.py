"""Which draft core a service runs: the model draft, the model-free suffix draft, or both.

model:  DraftService over a draft engine (edge/star/draft_service.py)
suffix: SuffixDraftService, no model at all: needs only the tokenizer's vocabulary size
hybrid: HybridDraftService: the suffix proposal when its score reaches min_score, else
        the model's
"""
from __future__ import annotations

from typing import Optional

from edge.star.draft_limits import DraftLimits

DRAFT_KINDS = ("model", "suffix", "hybrid")


def make_draft_core(kind: str, engine=None, limits: Optional[DraftLimits] = None, name: str = "draft",
                    vocab_size: Optional[int] = None, suffix_cfg=None, min_score: Optional[float] = None,
                    grammar_tokenizer=None):
    """The draft core for `kind` (a DraftService-like object for DraftNode). grammar_tokenizer: the
    model draft's tokenizer for grammars (edge/star/draft_grammar.py); None: drafts unconstrained."""
    if kind not in DRAFT_KINDS:
        raise ValueError(f"draft kind must be one of {', '.join(DRAFT_KINDS)}, got {kind!r}")
    if kind in ("model", "hybrid") and engine is None:
        raise ValueError(f"a {kind} draft needs a draft model (engine); `suffix` runs without one")
    if kind == "model":
        from edge.star.draft_service import DraftService
        return DraftService(engine, limits, name=name, grammar_tokenizer=grammar_tokenizer)
    if kind == "suffix":
        from edge.star.suffix_service import SuffixDraftService
        vocab = vocab_size if vocab_size is not None else getattr(engine, "vocab_size", None)
        if vocab is None:
            raise ValueError("a suffix draft needs the vocabulary size of the targets' tokenizer")
        return SuffixDraftService(vocab, limits, suffix_cfg, name=name,
                                  fingerprint=getattr(engine, "fingerprint", ""))
    from edge.star.draft_service import DraftService
    from edge.star.hybrid_service import MIN_SCORE, HybridDraftService
    return HybridDraftService(DraftService(engine, limits, name=name, grammar_tokenizer=grammar_tokenizer),
                              suffix_cfg,
                              min_score=MIN_SCORE if min_score is None else min_score, name=name)
