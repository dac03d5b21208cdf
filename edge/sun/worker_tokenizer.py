"""The tokenizer a SUN worker compiles request grammars against (edge/sun/token_rules.py).

A SUN worker decodes token ids and never needs a tokenizer, except to follow a request's grammar
(response_format, a forced tool_choice): llguidance masks tokens by their bytes. It is, in order,
the model `--tokenizer` names (a fetch name or a path: the base model the specialists were tuned
from), or the tokenizer a bundle carries (`edge-export bundle ... --tokenizer`). Without either the
worker serves no grammars: its hello says so and the router sends it none.
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable, Optional

from edge.model.sun_error import SunError
from edge.sun.token_rules import SunGrammars


def worker_grammars(module, tokenizer: Optional[str], vocab_size: int,
                    on_demand: bool = False) -> Optional[SunGrammars]:
    """The grammars a worker on `module` (its directory, bundle or ResolvedModel) can follow, or None.
    tokenizer: --tokenizer's value (None: the bundle's own, if it carries one). on_demand
    (--grammars-on-demand): the tokenizer and llguidance's are loaded at the first request with a
    grammar, not at start (~200 MB less for Qwen's 150k vocabulary until then; that request waits
    seconds, and a tokenizer that is not the base's refuses it then instead of the worker's start)."""
    load = _tokenizer_loader(module, tokenizer)
    if load is None:
        return None
    if not on_demand:
        return SunGrammars(_checked(load(), vocab_size), vocab_size).prepare()

    def make():
        from edge.speculative.grammar import GrammarError, grammar_tokenizer
        try:
            return grammar_tokenizer(_checked(load(), vocab_size), vocab_size)
        except GrammarError:
            raise
        except Exception as e:                            # unreadable or not this base's: that request's 400
            raise GrammarError(f"the worker's tokenizer: {e}") from None
    return SunGrammars(vocab_size=vocab_size, make=make)


def _tokenizer_loader(module, tokenizer: Optional[str]) -> Optional[Callable]:
    """What opens the worker's tokenizer (resolved now: a bad --tokenizer fails the start), or None."""
    from edge.engines.loader import bundle_tokenizer, open_tokenizer
    if tokenizer:
        from edge.engines.base import EngineError
        from edge.model.checkpoint_files import CheckpointError
        from edge.model.resolved import resolve
        try:
            where = resolve(tokenizer)
        except (CheckpointError, EngineError, OSError) as e:
            raise SunError(f"--tokenizer {tokenizer}: {e}") from None

        def opened():
            try:
                tok = open_tokenizer(where)
            except (CheckpointError, EngineError, OSError) as e:
                raise SunError(f"--tokenizer {tokenizer}: {e}") from None
            if tok is None:
                raise SunError(f"--tokenizer {tokenizer}: it carries no tokenizer")
            return tok
        return opened
    if (Path(module) / "manifest.json").is_file():
        try:
            from edge.model.bundle_manifest import read_manifest
            if read_manifest(Path(module)).get("tokenizer"):
                return lambda: bundle_tokenizer(Path(module))
        except Exception:                                 # a tuned directory's manifest, not a bundle's
            return None
    return None


def _checked(tok, vocab_size: int):
    if tok.vocab_size > vocab_size:
        raise SunError(f"the tokenizer has {tok.vocab_size} tokens, more than the model's {vocab_size}: "
                       "it is not this base's")
    return tok
