"""The OpenAI-compatible HTTP endpoint a device serves to its local clients (openai_http.py; a
streamed answer: streamed_answer.py), and
what it shares with the SUN hub's endpoint (server/sun_http.py): the rule for every request field
(request_fields.py, documented in docs/api.md), request parsing (request.py) and logprobs (logprobs.py).

May import: edge.speculative and below.
"""
