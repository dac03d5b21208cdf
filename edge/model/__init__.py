"""Model files and what they hold, without a runtime.

transformer.py (the Llama / Qwen2 module, torch), checkpoint.py (GGUF / HF loading, torch),
checkpoint_files.py, tokenizer.py, gguf_header.py, onnx_metadata.py (torch-free readers),
reference.py (`resolve_model`: the path a name or path names), resolved.py (`resolve`: the one
ResolvedModel a command makes of it -- format, manifest, display id, backend by the one `auto`
rule), shape.py (its dimensions and stored bytes, read from the files), fetch.py
(`python -m edge.model.fetch`: the real models from the registries), kv.py / kv_blob.py (the KV cache and its wire blob),
bundle_manifest.py, sun_modules.py / sun_error.py (SUN artifacts), lora/ (SUN specialists as
prefill-only LoRA adapters: PEFT files, per-row multi-adapter prefill), errors.py (`EngineError`).

May import: nothing else of edge/. torch only in transformer.py, checkpoint.py, kv.py, sun_modules.py, lora/ (not lora/error.py).
"""
