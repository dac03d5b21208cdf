"""The tokenizer a SUN worker compiles request grammars against (edge/sun/token_rules.py).

A SUN worker decodes token ids and never needs a tokenizer, except to follow a request's grammar
(response_format, a forced tool_choice): llguidance masks tokens by their bytes. It is, in order,
the model `--tokenizer` names (a fetch name or a path: the base model the specialists were tuned
from), or the tokenizer a bundle carries (`edge-export bundle ... --tokenizer`). Without either the
worker serves no grammars: its hello says so and the router sends it none.
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional

from edge.model.sun_error import SunError
from edge.sun.token_rules import SunGrammars


def worker_grammars(module, tokenizer: Optional[str], vocab_size: int) -> Optional[SunGrammars]:
    """The grammars a worker on `module` (its directory, bundle or ResolvedModel) can follow, or None.
    tokenizer: --tokenizer's value (None: the bundle's own, if it carries one)."""
    from edge.engines.loader import bundle_tokenizer, open_tokenizer
    tok = None
    if tokenizer:
        from edge.engines.base import EngineError
        from edge.model.checkpoint_files import CheckpointError
        from edge.model.resolved import resolve
        try:
            tok = open_tokenizer(resolve(tokenizer))
        except (CheckpointError, EngineError, OSError) as e:
            raise SunError(f"--tokenizer {tokenizer}: {e}") from None
        if tok is None:
            raise SunError(f"--tokenizer {tokenizer}: it carries no tokenizer")
    elif (Path(module) / "manifest.json").is_file():
        try:
            tok = bundle_tokenizer(Path(module))
        except Exception:                                 # a tuned directory's manifest, not a bundle's
            tok = None
    if tok is None:
        return None
    if tok.vocab_size > vocab_size:
        raise SunError(f"the tokenizer has {tok.vocab_size} tokens, more than the model's {vocab_size}: "
                       "it is not this base's")
    return SunGrammars(tok, vocab_size).prepare()
