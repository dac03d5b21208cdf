"""What an answer reports about its generation: OpenAI's `usage`, and `timings`, what the
generation cost, in llama-server's names (the peer a user compares against: its
OpenAI-compatible answers carry the same object), plus two of ours.

    cache_n, prompt_n          prompt tokens reused from a prompt cache / prefilled
    prompt_ms, prompt_per_second
    predicted_n, predicted_ms, predicted_per_second    completion tokens, decode time
    draft_n, draft_n_accepted  tokens the draft proposed / the target accepted
    forced_n                   tokens a grammar forced, committed without a target call of their own
    verify_n                   target calls after the prefill

Only for a generation that reports them (a GenResult: edge/speculative/gen_result.py); None
otherwise, and the answer then has no `timings`.
"""
from __future__ import annotations

from typing import Optional


def usage(prompt_tokens: int, n: int, cached: int = 0) -> dict:
    """OpenAI's usage; prompt_tokens_details.cached_tokens: prompt tokens whose KV was reused."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": n, "total_tokens": prompt_tokens + n,
            "prompt_tokens_details": {"cached_tokens": cached}}


def timings_field(times: Optional[dict]) -> dict:
    """The answer's fields for `times`: {"timings": times}, or none."""
    return {} if times is None else {"timings": times}


def _rate(n: int, seconds: float) -> float:
    return n / seconds if seconds > 0 else 0.0


def timings(res, prompt_tokens: int, completion_tokens: int) -> Optional[dict]:
    """The `timings` object of an answer generated as `res` (None: nothing to report)."""
    if res is None or not hasattr(res, "n_verify_calls"):
        return None
    cached = int(res.cached_tokens or 0)
    prompt_s, decode_s = max(0.0, res.prefill_s), max(0.0, res.decode_s)
    return {"cache_n": cached, "prompt_n": prompt_tokens - cached, "prompt_ms": 1e3 * prompt_s,
            "prompt_per_second": _rate(prompt_tokens - cached, prompt_s),
            "predicted_n": completion_tokens, "predicted_ms": 1e3 * decode_s,
            "predicted_per_second": _rate(completion_tokens, decode_s),
            "draft_n": res.n_drafted, "draft_n_accepted": res.n_accepted,
            "forced_n": res.n_forced, "verify_n": res.n_verify_calls}
