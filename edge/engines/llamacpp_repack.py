"""Whether llama.cpp repacks a GGUF's weights for the CPU (its extra buffer types), and why.

Repacking (ggml-cpu's interleaved layouts, llama-server's default) decodes faster on some files but
prefills K-quants slower on x86, where the unrepacked ones take llama.cpp's tiled matmul
(Qwen2.5-Coder-1.5B Q4_K_M, two threads of an AMD EPYC, a 1,024-token prefill: 173-228 tok/s
unrepacked vs 121-135 repacked; a decode step ~15% faster repacked on a Xeon; docs/models.md). An
agent's turn is mostly prefill, so `auto` leaves such files unrepacked. Repacking does not bear on
exactness: rows round alike repacked or not under `--exact-rows` (edge/engines/llamacpp_rows.py),
and by the call's shape either way without it. The choice is a mode (`--repack`, LlamaCppEngine's extra_bufts):

    auto  repack where every weight type is in REPACKED_BY_AUTO, else not
    on    repack (faster decode on K-quants, slower prefill)
    off   never repack
    both  repack, and run long prefills on an unrepacked copy (edge/engines/llamacpp_twin.py)

A llama.cpp built with ggml's AMX backend crashes on repacked quantised weights (upstream
llama.cpp issue 20824): there repacking stays off whatever was asked, and the reason says so.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional

REPACK_MODES = {"auto": None, "on": True, "off": False}     # --repack -> LlamaCppEngine(extra_bufts=...)

def repack_kwargs(mode: str) -> dict:
    """LlamaCppEngine's arguments for `--repack mode` (auto: none, the engine chooses; both: repacked
    with an unrepacked copy for long prefills: llamacpp_twin.py)."""
    if mode == "both":
        return {"extra_bufts": True, "prefill_twin": True}
    return {} if mode == "auto" else {"extra_bufts": REPACK_MODES[mode]}


# ggml types that `auto` repacks (F32, F16, Q4_0, Q4_1, Q8_0, BF16): llama.cpp's default, kept (a Q4_0
# target repacked: agent_workload/q4_0_target); any other type (Q4_K, Q6_K, Q5_0, ...), not measured
# or measured to prefill slower repacked, keeps the file unrepacked.
REPACKED_BY_AUTO = frozenset({0, 1, 2, 3, 8, 30})
AMX_REFUSAL = ("this llama.cpp was built with ggml's AMX backend, whose repacked quantised weights crash "
               "(llama.cpp issue 20824); rebuild it with AMX off (`make llama`) to repack")
SLOWER_PREFILL = "a long prompt prefills slower repacked (docs/models.md)"


def amx_compiled(llama_cpp) -> bool:
    """Was this llama.cpp built with ggml's AMX backend? It segfaults in the first matmul of a
    quantised model on AMX CPUs (upstream llama.cpp issue 20824); `make llama` builds without it."""
    return "AMX_INT8 = 1" in llama_cpp.llama_print_system_info().decode(errors="replace")


def unrepacked_types(path: str) -> Optional[List[str]]:
    """The GGUF's weight types (ggml names) that keep `auto` from repacking it; None when the header
    cannot be read (then `auto` does not repack)."""
    from gguf.constants import GGMLQuantizationType
    from edge.model.gguf_header import GGUFHeaderError, read_gguf_header
    try:
        types = {t.ggml_type for t in read_gguf_header(path).tensors}
    except (OSError, GGUFHeaderError):
        return None
    return sorted(_type_name(t, GGMLQuantizationType) for t in types - REPACKED_BY_AUTO)


def _type_name(t: int, names) -> str:
    try:
        return names(t).name
    except ValueError:
        return f"type {t}"


def auto_repacks(path: str) -> bool:
    """Does `--repack auto` repack the GGUF at `path` (every weight type in REPACKED_BY_AUTO)?"""
    return unrepacked_types(path) == []


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
    bad = unrepacked_types(path)
    kept = (f"{', '.join(bad)} weights stay unrepacked: {SLOWER_PREFILL}, or not measured" if bad
            else "its header could not be read to check its weight types" if bad is None else "")
    if asked:
        return RepackChoice(True, "on as asked" + (f"; {SLOWER_PREFILL}" if kept else ""))
    if kept:
        return RepackChoice(False, f"auto: {kept}; --repack on decodes K-quants faster: chats of short "
                                   f"prompts, several at once; --repack both takes each layout where it is "
                                   f"faster, at ~2x the weight memory")
    return RepackChoice(None, "auto: llama.cpp's default for every weight type of this GGUF")
