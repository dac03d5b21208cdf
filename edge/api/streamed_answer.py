"""One streamed answer of the OpenAI endpoint (edge/api/openai_http.py): Server-Sent Events, its 200
and headers sent with the first chunk (so that a generate refused before any token can still
answer 503), text or tool-call deltas as the tokens come, the final chunk with the timings and the
usage, and an error event where the generation fails after the stream began."""
from __future__ import annotations

import json
import logging
from typing import Optional

from edge.api.admission import Unavailable
from edge.api.request import Request
from edge.api.request_fields import BadRequest
from edge.api.timings import timings_field, usage
from edge.api.tools import CallStream, call_stream

log = logging.getLogger("edge.api.openai_http")


class StopGeneration(Exception):
    """Raised from the token callback to end a generation early (stop text, client gone)."""


def tool_message(calls: CallStream, finish: str) -> tuple:
    """(the assistant message, finish_reason) of a reply with tools offered, from its parsed calls."""
    if not calls.calls:
        return {"role": "assistant", "content": calls.content}, finish
    # a reply cut inside a call's arguments keeps its own finish (length), as OpenAI's cut calls
    return ({"role": "assistant", "content": calls.content or None, "tool_calls": calls.calls},
            finish if calls.incomplete else "tool_calls")


class StreamedAnswer:
    """One streamed answer. Its 200 and headers go out with the first chunk, so that a generate
    refused before any token (Unavailable) can still answer 503."""

    def __init__(self, handler, head: dict, req: Request):
        self.h, self.head, self.req = handler, head, req
        self.obj = "chat.completion.chunk" if req.chat else "text_completion"
        self.rec = handler.owner.recorder(req)
        self.started = False
        self.offset = 0                       # completions' text_offset: characters sent so far

    def _start(self) -> None:
        h = self.h
        h.send_response(200)
        h.send_header("Content-Type", "text/event-stream")
        h.send_header("Cache-Control", "no-cache")
        h.send_header("Connection", "close")
        h.end_headers()
        h.close_connection = True
        self.started = True
        if self.req.chat:
            self.send({"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                       "finish_reason": None})

    def send(self, choice: Optional[dict], usage: Optional[dict] = None, extra: Optional[dict] = None) -> None:
        if not self.started:
            self._start()
        chunk = {**self.head, "object": self.obj, "choices": [choice] if choice else [], **(extra or {})}
        if self.req.include_usage:
            chunk["usage"] = usage            # null on every chunk but the last (as OpenAI)
        try:
            self.h.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
            self.h.wfile.flush()
        except OSError:
            raise StopGeneration() from None              # the client left: stop generating

    def delta(self, text: str, entries: list, finish=None) -> dict:
        if self.req.chat:
            lp = self.rec.chat(entries) if self.rec else None
            return {"index": 0, "delta": {"content": text} if text else {}, "logprobs": lp, "finish_reason": finish}
        lp = self.rec.completion(entries, self.offset) if self.rec else None
        self.offset += len(text)
        return {"index": 0, "text": text, "logprobs": lp, "finish_reason": finish}

    def run(self) -> None:
        try:
            if self.req.tools is not None:     # text streams up to a tool call; calls go whole, at the end
                n, finish, cached, times = self._tool_reply()
            else:
                _, n, finish, cached, times = self.h.owner.run(
                    self.req, lambda s, lp: self.send(self.delta(s, lp)), self.rec)
            self.send(self.delta("", [], finish), extra=timings_field(times))     # as llama-server's last chunk
            if self.req.include_usage:
                self.send(None, usage(len(self.req.ids), n, cached))
            self.h.wfile.write(b"data: [DONE]\n\n")
            self.h.wfile.flush()
        except (StopGeneration, OSError):
            return
        except Unavailable as e:
            if not self.started:
                self.h._unavailable(e)
                return
            self._fail(e)
        except BadRequest as e:
            if not self.started:
                self.h._error(400, str(e)[:1000], param=e.param)
                return
            self._fail(e)
        except Exception as e:
            log.exception("generation failed")
            if not self.started:
                self.h._error(500, f"generation failed: {e}", "server_error")
                return
            self._fail(e)

    def _tool_reply(self) -> tuple:
        """Stream a reply with tools offered as OpenAI does: its text as content deltas (what may
        start a call held back: edge/api/tool_formats/stream.py), each call's id, type and
        function.name as soon as they are known, then its function.arguments as string deltas as
        the tokens arrive
        (choices[0].delta.tool_calls = [{index, id?, type?, function: {name?, arguments}}]);
        -> (tokens, finish_reason: tool_calls when there are calls, cached prompt tokens, timings)."""
        calls, entries = call_stream(self.req.tools), []

        def send(events) -> None:
            for ev in events:
                if ev[0] == "content":
                    self.send(self.delta(ev[1], entries))
                elif ev[0] == "call":
                    c = ev[2]
                    self.send(self._calls_delta({"index": ev[1], "id": c["id"], "type": "function",
                                                 "function": {"name": c["function"]["name"], "arguments": ""}},
                                                entries))
                else:
                    self.send(self._calls_delta({"index": ev[1], "function": {"arguments": ev[2]}}, entries))
                entries.clear()

        def emit(s: str, lp: list) -> None:
            entries.extend(lp)
            send(calls.feed(s))
        _, n, finish, cached, times = self.h.owner.run(self.req, emit, self.rec)
        send(calls.finish())
        if entries:                                # logprobs of tokens that made no text
            self.send(self.delta("", entries))
        return n, tool_message(calls, finish)[1], cached, times

    def _calls_delta(self, call: dict, entries: list) -> dict:
        lp = self.rec.chat(entries) if self.rec else None
        return {"index": 0, "delta": {"tool_calls": [call]}, "logprobs": lp, "finish_reason": None}

    def _fail(self, e: Exception) -> None:
        try:
            self.h.wfile.write(f"data: {json.dumps({'error': {'message': str(e)}})}\n\n".encode())
        except OSError:
            pass
