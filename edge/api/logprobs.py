"""Logprobs for the OpenAI answers, from the target's own rows (generate's on_logits).

What is reported: log-softmax of the target's logits at each position, after
the request's penalties and logit_bias and before temperature, top-k and
top-p -- the model's distribution as OpenAI and vLLM report it, the one that
greedy decoding argmaxes. The row is the target's whether the token was
drafted or decoded alone (the verify call computes it either way), so a
speculative answer's logprobs are the target-only answer's.
"""
from __future__ import annotations

from functools import lru_cache
from typing import Dict, List, Tuple

import numpy as np

from edge.speculative.sampling import top_logprobs


@lru_cache(maxsize=1)
def _byte_of_char() -> Dict[str, int]:
    """The byte-level BPE alphabet (GPT-2's bytes_to_unicode), inverted: char -> byte."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    chars, n = list(keep), 0
    for b in range(256):
        if b not in keep:
            keep.append(b)
            chars.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(keep, chars)}


def token_bytes(tok, token: int) -> bytes:
    """A token's own bytes (a byte-level piece may be part of a UTF-8 character)."""
    piece = tok.id_to_token(token) or ""
    table = _byte_of_char()
    if piece and all(c in table for c in piece):
        return bytes(table[c] for c in piece)
    return tok.decode([token]).encode("utf-8")


class LogprobRecorder:
    """Collects (token, logprob, alternatives) as the generation commits tokens; `take` hands
    over what came since the last take (a stream's chunk carries its tokens' entries)."""

    def __init__(self, tok, top_n: int):
        self.tok, self.top_n = tok, top_n
        self.entries: List[Tuple[int, float, list]] = []
        self._taken = 0

    def on_logits(self, token: int, row: np.ndarray) -> None:
        lp, alts = top_logprobs(row, token, self.top_n)
        self.entries.append((token, lp, alts))

    def on_entry(self, token: int, logprob: float, alts) -> None:
        """An entry computed where the row was (a SUN worker: top_logprobs over its masked row)."""
        self.entries.append((int(token), float(logprob), [(int(t), float(a)) for t, a in alts][:self.top_n]))

    @property
    def pending(self) -> bool:
        return self._taken < len(self.entries)

    def take(self) -> List[Tuple[int, float, list]]:
        out, self._taken = self.entries[self._taken:], len(self.entries)
        return out

    def _text(self, token: int) -> Tuple[str, List[int]]:
        raw = token_bytes(self.tok, token)
        return raw.decode("utf-8", errors="replace"), list(raw)

    def chat(self, entries) -> dict:
        """A chat choice's logprobs: {content: [{token, logprob, bytes, top_logprobs}]}."""
        content = []
        for token, lp, alts in entries:
            text, raw = self._text(token)
            tops = []
            for t, alp in alts:
                atext, araw = self._text(t)
                tops.append({"token": atext, "logprob": alp, "bytes": araw})
            content.append({"token": text, "logprob": lp, "bytes": raw, "top_logprobs": tops})
        return {"content": content, "refusal": None}

    def completion(self, entries, offset: int = 0) -> dict:
        """A completion choice's logprobs: tokens, token_logprobs, top_logprobs, text_offset
        (offset: the text already sent before these entries)."""
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for token, lp, alts in entries:
            text = self._text(token)[0]
            out["tokens"].append(text)
            out["token_logprobs"].append(lp)
            out["top_logprobs"].append({self._text(t)[0]: alp for t, alp in alts})
            out["text_offset"].append(offset)
            offset += len(text)
        return out
