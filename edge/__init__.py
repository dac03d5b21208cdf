"""The device side of StarSun: everything that runs on a Jetson-class device (and inside the hub).

Packages by concern, lowest layer first (the import-linter contracts in pyproject.toml check it):

    wire/       the star's wire format: messages, envelope + HMAC, topics, the MQTT / in-memory link
    model/      model files: the transformer, checkpoints, tokenizers, KV blobs, fetched models
    engines/    the Engine interface and its backends (torch, onnxruntime, llama.cpp)
    speculative/ speculative decoding: sampling, the lossless verify math, drafters, local generation, γ policies
    runtime/    the one engine loop and the node base every networked role runs on
    star/       StarSD roles: the draft service (model, suffix, hybrid), its node, the target
    sun/        SUN roles: prefill workers, the shared decoder, the client
    telemetry/  readings, Prometheus /metrics, the publisher
    memory/     whether a role fits a device's memory
    api/        the OpenAI-compatible HTTP endpoint of a device
    cli/        `edge-agent`: the command line and the factory that builds a role

Nothing under edge/ imports server/, export/ or devices' provisioning.
"""
