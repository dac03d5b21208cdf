"""The star's wire format, and the links it travels on.

protocol.py (the message table: `encode`, `decode`, every message class; the SUN ones in
sun_messages.py, limits and error codes in limits.py), envelope.py (the envelope, msgpack and
HMAC), field_types.py (per-field checks), topics.py (the topic grammar), link.py (`Link`, `MqttLink`
on paho-mqtt), brokers.py (broker URLs, a list of nodes to fail over along), memory_link.py (an
in-process bus for tests and one-process demos), seen_ids.py and replay_guard.py (replay
protection).

May import: nothing else of edge/. No torch, no numpy beyond array fields.
"""
