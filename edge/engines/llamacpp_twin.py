"""`--repack both`: a second copy of the weights, unrepacked, that computes the long prefills.

On x86 a K-quant GGUF decodes faster repacked (llama.cpp's interleaved layouts) and prefills faster
unrepacked (its tiled matmul): Qwen2.5-Coder-1.5B Q4_K_M on one thread of an AMD EPYC, a 1,024-token
prefill 18.2 s repacked vs 10.6 s unrepacked, a decode step ~1.2x faster repacked (docs/models.md).
One layout loses one side. With a twin, the engine's own model is repacked (decode, verify, a
batch of requests) and a prefill of at least `min_rows` tokens runs on the twin: the sequence's
cached KV is copied into the twin's one-sequence context, the new tokens are fed there, and the
whole sequence's KV is copied back (llama.cpp's own sequence state, its frame rewritten in place
between the two contexts' stream counts: llamacpp_kv.to_one_stream / from_one_stream). A copy is a
memcpy of the sequence's KV (~28 KB a token on the 1.5B): 1,800 cached tokens there and back cost
~0.2 s, so a 64-token turn after them still gained 1.19x, a 1,024-token prompt 1.69x (one thread).

Memory: the model reads its weights (repacked, as `--repack on` does) and the twin maps the file,
so weights cost ~2x a single layout, plus the twin's KV for one sequence of max_len tokens and the
buffer a sequence's state moves through (edge/memory/fit.py; the 1.5B Q4_K_M at 4,096 tokens:
2,641 MiB peak RSS measured vs 1,393 repacked alone). Not with --exact-rows: a row the twin
computes rounds unlike the repacked model's, so a prompt cache's reused KV would not be bit-equal
to a cold prefill (the engine refuses the pair). Not with LoRA adapters (they live on one model).
"""
from __future__ import annotations

import ctypes
import time
from typing import Sequence

import numpy as np

from edge.engines.base import EngineError

MIN_ROWS = 64        # shorter prefills stay on the repacked model: a few rows decode faster there


class PrefillTwin:
    """The unrepacked copy of a LlamaCppEngine's GGUF and its one-sequence context."""

    def __init__(self, main, engine_class, max_len: int, n_batch: int, kv_type: str, min_rows: int = MIN_ROWS):
        self.engine = engine_class(main.path, max_len=max_len, n_seq_max=1, threads=main.threads,
                                     fingerprint=main.fingerprint, n_batch=n_batch, kv_type=kv_type,
                                     flash_attn=main.flash_attn, extra_bufts=False, mmap=True)
        self.engine.tile_costs = main.tile_costs
        self.min_rows = int(min_rows)
        self._seq = self.engine.new_sequence()
        self._buf = bytearray()       # sequence state on its way between the two contexts
        self.stats = {"prefills": 0, "tokens": 0, "copied_tokens": 0, "copy_s": 0.0}

    def describe(self) -> str:
        return f"; prefills of {self.min_rows}+ tokens on an unrepacked copy (--repack both)"

    def takes(self, n_new: int) -> bool:
        return n_new >= self.min_rows

    def feed(self, main, seq: int, tokens: Sequence[int], n_rows: int) -> np.ndarray:
        """main._feed on the twin: the logits of the last n_rows of `tokens` (0: all), the sequence's
        KV in main extended by them. On an error main's sequence is as it was."""
        slot, held = main._get(seq), list(main._tokens[seq])
        main._apply_queued_copies(slot, len(held))
        twin, tseq, t0 = self.engine, self._seq, time.monotonic()
        twin.truncate(tseq, 0)
        if held:
            self._move(main, slot, twin, twin._get(tseq))
            twin._tokens[tseq] = list(held)
        copy_s = time.monotonic() - t0
        try:
            logits = twin._feed(tseq, tokens, n_rows)
            t1 = time.monotonic()
            self._move(twin, twin._get(tseq), main, slot)
            copy_s += time.monotonic() - t1
        except BaseException:
            self._restore(main, seq, slot, held)
            raise
        finally:
            twin.truncate(tseq, 0)
        main._tokens[seq].extend(int(t) for t in tokens)
        s = self.stats
        s["prefills"] += 1
        s["tokens"] += len(tokens)
        s["copied_tokens"] += 2 * len(held) + len(tokens)
        s["copy_s"] += copy_s
        return logits

    def _move(self, src, src_slot: int, dst, dst_slot: int) -> None:
        """Copy one sequence's KV from src's slot to dst's (two contexts of this GGUF), through one
        buffer kept between calls (a fresh one would cost its page faults on every copy)."""
        from edge.engines.llamacpp_kv import StateError, from_one_stream, to_one_stream
        lc = src._lc
        n = lc.llama_state_seq_get_size(src._ctx, src_slot)
        pad = 4 * dst_slot if src.n_seq_max == 1 else 0     # room for the streams before dst_slot
        need = pad + n + 4 * dst.n_seq_max
        if len(self._buf) < need:        # grown ahead, up to max_len tokens' worth: a conversation grows every
            cells = int(lc.llama_memory_seq_pos_max(src._mem, src_slot)) + 1      # turn, a new buffer faults in
            full = need * self.engine.max_len // max(1, cells)                    # its pages again
            self._buf = bytearray(max(need, min(2 * len(self._buf), full)))
        buf = self._buf
        if lc.llama_state_seq_get_data(src._ctx, buffer_at(buf, pad), n, src_slot) != n:
            raise EngineError(f"llama.cpp wrote less than the {n} bytes of a sequence's state")
        try:
            if src.n_seq_max == 1:
                at, length = 0, from_one_stream(buf, n, dst_slot, dst.n_seq_max)
            else:
                at, length = to_one_stream(buf, n, src_slot)
        except StateError as e:
            raise EngineError(f"cannot move a sequence's KV between the prefill twin and the model: {e}") from None
        if lc.llama_state_seq_set_data(dst._ctx, buffer_at(buf, at), length, dst_slot) != length:
            raise EngineError("llama.cpp refused a sequence's KV moved from the prefill twin (no room in its cache)")

    def _restore(self, main, seq: int, slot: int, held: list) -> None:
        """main's sequence after a failed twin prefill, as it was: its KV is untouched unless the copy
        back failed after llama.cpp had cleared it (it starts there); then the held cells go back
        from the twin, which still has them (or, if that fails too, the tokens are cut to what is left)."""
        lc, twin, tseq = main._lc, self.engine, self._seq
        if int(lc.llama_memory_seq_pos_max(main._mem, slot)) + 1 == len(held):
            return
        try:
            twin.truncate(tseq, min(len(held), twin.length(tseq)))
            if twin.length(tseq) == len(held):
                self._move(twin, twin._get(tseq), main, slot)
        except EngineError:
            pass
        kept = int(lc.llama_memory_seq_pos_max(main._mem, slot)) + 1
        lc.llama_memory_seq_rm(main._mem, slot, min(kept, len(held)), -1)
        del main._tokens[seq][min(kept, len(held)):]

    def close(self) -> None:
        self.engine.close()


def open_twin(main, engine_class, asked: bool, max_len: int, n_batch: int, kv_type: str):
    """main's PrefillTwin (an engine_class, LlamaCppEngine, unrepacked) when asked for and it can help
    (main's weights repacked, on the CPU), else None."""
    if not asked:
        return None
    if main.exact_rows:
        raise EngineError("--repack both cannot go with --exact-rows: a row the unrepacked twin computes "
                          "rounds unlike the repacked model's; use --repack on or off with --exact-rows")
    if not main.repack.on or main.gpu_layers:
        return None            # nothing to gain: one layout already (the start line says why)
    return PrefillTwin(main, engine_class, max_len, n_batch, kv_type)


def buffer_at(buf: bytearray, offset: int):
    """A pointer to buf[offset:] for llama.cpp."""
    return ctypes.cast(ctypes.addressof((ctypes.c_uint8 * len(buf)).from_buffer(buf)) + offset,
                       ctypes.POINTER(ctypes.c_uint8))
