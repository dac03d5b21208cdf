"""SUN specialists as prefill-only LoRA adapters over one frozen base (issue 37).

A specialist is a LoRA adapter (PEFT's files: adapter_config.json + adapter_model.safetensors)
applied to the base only while prefilling; the shared decoder is the base itself and never
sees an adapter. Modules, one idea each:

* error.py   -- `AdapterError`, the one error of a bad adapter (torch-free).
* adapter.py -- `LoraAdapter` (the adapter as tensors), its targets, PEFT's initialisation,
                `base_fingerprint` (what an adapter records of the base it was made for).
* files.py   -- `save_adapter` / `load_adapter` (PEFT's on-disk format, validated) and
                `adapter_sha256`.
* apply.py   -- `LoraTransformer` (the prefill context: the base's weights shared, adapters
                applied per batch row, as Punica / S-LoRA do) and `lora_prefill`.

This __init__ imports nothing, so a torch-free role can import error.py alone.
"""
