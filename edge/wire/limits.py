"""The wire format's limits, roles and error codes (edge/wire/protocol.py re-exports them; the
per-field limits live with their checkers in edge/wire/field_types.py)."""
from __future__ import annotations

MAX_APPEND = 32768             # tokens fed in one request (a whole prompt at first)
MAX_KEEP = 1 << 20             # longest sequence a draft may be asked to keep
SUN_CHUNK_BYTES = 2 << 20      # KV bytes per KVChunk (well under MAX_MESSAGE_BYTES)
MAX_KV_CHUNKS = 4096           # 8 GiB: any receiver applies its own, smaller memory limit
MAX_NEW_TOKENS = 1 << 16       # tokens one SUN request may ask for
MAX_HELD = 4096               # session ids a DraftHello lists (~70 KB); past it, none
MAX_ENDED = 64                 # session ids a Join names as ended by its client (its newest)
MAX_STOP = 64                  # stop token ids per request
MAX_STREAM_TOKENS = 256        # tokens in one SunTokens message
JOIN_ROLES = ("target", "prefill", "decoder", "drafter")  # SUN roles reserved; drafter: the reverse star
SUN_ROLES = ("prefill", "decoder")
TELEMETRY_ROLES = ("target", "draft", "prefill", "decoder", "hub", "drafter", "verify")
FINISH_REASONS = ("stop", "length", "context")

# Error codes (Error.code).
E_BAD_KEEP = "bad_keep"                 # keep > what the draft holds for the session
E_UNKNOWN_SESSION = "unknown_session"   # evicted or never assigned: rejoin
E_OVERLOADED = "overloaded"             # session / KV limits reached
E_BAD_REQUEST = "bad_request"
E_INTERNAL = "internal"
E_UNKNOWN_TASK = "unknown_task"         # SUN: no prefill worker serves the task
E_NO_DECODER = "no_decoder"             # SUN: no decoder fits the task's KV (fingerprint / pool)
E_REFUSED = "refused"                   # SUN: the decoder refused the KV blob (reason in message)
E_TIMEOUT = "timeout"                   # SUN: the KV cache never arrived at the decoder
E_WORKER_LOST = "worker_lost"           # SUN: the request's decoder went offline mid-request: resend
E_BAD_GRAMMAR = "bad_grammar"           # StarSD: the draft cannot use the request's grammar (reason in message)
E_CONTEXT_FULL = "context_full"        # reverse star: the hub's target has no room for the request's context
