"""Will a role fit? A model's shape read from its files, and the memory plan built on it.

model_shape.py (`read_shape`: a model's dimensions and stored bytes without loading, read by
edge/model/shape.py), fit.py (peak =
runtime + tokenizer + weights + KV + compute buffers; the most that fits a budget), placed.py
(where those bytes live once placed: host, GPU, or a Jetson's shared pool).

May import: edge.engines, edge.model.
"""
