"""Will a role fit? A model's shape read from its files, and the memory plan built on it.

model_shape.py (`read_shape`: dimensions and stored bytes without loading), plan.py (peak =
runtime + tokenizer + weights + KV + compute buffers; the most that fits a budget), placed.py
(where those bytes live once placed: host, GPU, or a Jetson's shared pool).

May import: edge.engines, edge.model.
"""
