"""The one Engine interface (base.py) and its backends: torch, onnxruntime, llama.cpp.

llamacpp_engine.py opens its GGUF with llamacpp_load.py. placement.py decides where a role's
model runs (`decide_placement`: --accelerator / --gpu-layers, the profile, what the runtime can do).
`open_model(model)` in loader.py is the entry point: (engine, tokenizer) for a ResolvedModel
(edge/model/resolved.py), or a name, file or bundle resolved there. Logits come back as numpy so the verify math never sees a backend.

May import: edge.model. A backend imports its runtime lazily (llama.cpp and onnxruntime roles never load torch).
"""
