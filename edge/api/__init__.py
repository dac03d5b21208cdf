"""The OpenAI-compatible HTTP endpoint a device serves to its local clients (openai_http.py).

May import: edge.spec and below.
"""
