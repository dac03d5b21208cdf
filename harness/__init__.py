"""The harness that tests and benchmarks share: what drives the kit, never part of it.

Neither installed nor shipped to devices: it is imported from the repository root (pytest's
`pythonpath`, `python -m benchmarks...`, `python -m harness.<module>` for the helpers that
run as processes). It may import edge, server and export; nothing in edge, server, export or
devices may import it (pyproject.toml's import-linter contracts).

Small models and engines
    tiny_models      tiny float64 llamas, SUN specialists, a small BPE tokenizer
    tiny_hf          the same as Hugging Face directories (config, safetensors, tokenizer)
    table_engine     a deterministic toy model (hash-indexed table of logits) for the verify math
    goodness_of_fit  chi-square tools: sampled outputs against the exact distribution
    star_sampling    seeded sampling through a star, fitted to the exact distribution
    draft_services   a draft service core on a tiny model and the steps its tests take
    fuzz             Hypothesis settings and strategies for hostile values
Live stars
    console_scripts  `edge-hub` / `edge-agent` as processes (Procs) and the models they load
    star_processes   the same, paused and killed for the process-fault tests
    sun_star         a SUN star (router, prefill workers, decoders, a client), each on its own MQTT link
    http_endpoints   the OpenAI and SUN HTTP endpoints on a memory bus
    mosquitto_clients  third-party mosquitto_pub / mosquitto_sub clients, for attacks
    netns, netns_star  hosts in network namespaces, and the star across them
    netns_rabbit_star, namespace_star_base  the same over a RabbitMQ cluster, and what both share
    rabbitmq         RabbitMQ nodes and clusters (tls_cluster: three TLS nodes with their users)
    gguf_star        a small real star (hub, remote draft, target) on SmolLM2 GGUF for broker tests
    agent_asks       what the real-model tests ask as agents do, and their skip without the models
    delay_proxy      a TCP proxy that adds latency and jitter (run: python -m harness.delay_proxy)
    ssh_device       a real sshd "device" for provisioning tests
Load
    emulated_target  emulated target devices: the real target code on a timed fake engine
    load_targets     many emulated targets in a few processes (run: python -m harness.load_targets)
    load_star, load_sun, load_monitor  the StarSD and SUN load and the sampler that watches them
Waiting
    waiting          wait_until(predicate, timeout)
    at_once          calls run at once in threads, their results and errors
"""
