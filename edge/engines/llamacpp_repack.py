"""Whether llama.cpp repacks a GGUF's weights for the CPU (its extra buffer types), and why.

Repacking (ggml-cpu's interleaved layouts, llama-server's default) decodes faster on some files,
but for weight types such as Q4_K a verify over k rows then rounds differently from k one-row
calls, so greedy text through a draft or the star can leave the target's own plain greedy text at
a near-tie (docs/models.md). The choice is a mode (`--repack`, LlamaCppEngine's extra_bufts):

    auto  repack where every weight type keeps rows exact when repacked, else not
    on    repack (faster decode on K-quants; exactness no longer guaranteed)
    off   never repack

A llama.cpp built with ggml's AMX backend crashes on repacked quantised weights (upstream
llama.cpp issue 20824): there repacking stays off whatever was asked, and the reason says so.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional

REPACK_MODES = {"auto": None, "on": True, "off": False}     # --repack -> LlamaCppEngine(extra_bufts=...)

# ggml types whose weights ggml-cpu may repack and whose multi-row calls were measured to round as
# one-row calls do (F32, F16, Q4_0, Q4_1, Q8_0, BF16): greedy speculative text stays the plain text
# bit for bit. Q4_K repacked did not (docs/models.md), nor is any other type measured.
ROW_EXACT_WHEN_REPACKED = frozenset({0, 1, 2, 3, 8, 30})
AMX_REFUSAL = ("this llama.cpp was built with ggml's AMX backend, whose repacked quantised weights crash "
               "(llama.cpp issue 20824); rebuild it with AMX off (`make llama`) to repack")
NEAR_TIES = "speculative greedy text may leave the target's plain greedy text at near-ties"


def amx_compiled(llama_cpp) -> bool:
    """Was this llama.cpp built with ggml's AMX backend? It segfaults in the first matmul of a
    quantised model on AMX CPUs (upstream llama.cpp issue 20824); `make llama` builds without it."""
    return "AMX_INT8 = 1" in llama_cpp.llama_print_system_info().decode(errors="replace")


def inexact_types(path: str) -> Optional[List[str]]:
    """The GGUF's weight types (ggml names) not known to keep a k-row verify equal to k one-row
    calls when repacked; None when the header cannot be read (then none is assumed exact)."""
    from gguf.constants import GGMLQuantizationType
    from edge.model.gguf_header import GGUFHeaderError, read_gguf_header
    try:
        types = {t.ggml_type for t in read_gguf_header(path).tensors}
    except (OSError, GGUFHeaderError):
        return None
    return sorted(_type_name(t, GGMLQuantizationType) for t in types - ROW_EXACT_WHEN_REPACKED)


def _type_name(t: int, names) -> str:
    try:
        return names(t).name
    except ValueError:
        return f"type {t}"


def repack_keeps_rows_exact(path: str) -> bool:
    """Does every tensor of the GGUF have a type whose CPU repacking keeps a verify of k rows equal
    to k one-row calls? (Read from the header; an unreadable header: False, the safe answer.)"""
    return inexact_types(path) == []


@dataclass(frozen=True)
class RepackChoice:
    """What llama.cpp is told (use_extra_bufts: None = its default, on) and why, for the start line."""
    extra_bufts: Optional[bool]
    why: str
    amx_guard: bool = False          # off because this build's AMX backend would crash (`on` asked or not)

    @property
    def on(self) -> bool:
        return self.extra_bufts is not False

    def describe(self) -> str:
        return f"weight repacking {'on' if self.on else 'off'} ({self.why})"


def choose_repack(asked: Optional[bool], amx: bool, path: str) -> RepackChoice:
    """The repacking of the GGUF at `path` for `asked` (None auto, True on, False off) on a build with
    (amx) or without ggml's AMX backend. Pure but for reading the GGUF's header."""
    if asked is False:
        return RepackChoice(False, "off as asked")
    if amx:
        if asked:
            return RepackChoice(False, f"on was asked, refused: {AMX_REFUSAL}", amx_guard=True)
        return RepackChoice(False, f"auto: {AMX_REFUSAL}", amx_guard=True)
    bad = inexact_types(path)
    rows = (f"{', '.join(bad)} weights are not known to keep a verify's rows exact when repacked" if bad
            else "its header could not be read to check its weight types" if bad is None else "")
    if asked:
        if not rows:
            return RepackChoice(True, "on as asked; every weight type of this GGUF keeps a verify's rows exact "
                                      "when repacked")
        return RepackChoice(True, f"on as asked: {NEAR_TIES}; {rows}")
    if rows:
        return RepackChoice(False, f"auto: {rows}; --repack on trades exact speculative greedy text for decode "
                                   "speed")
    return RepackChoice(None, "auto: every weight type of this GGUF keeps a verify's rows exact when repacked")
