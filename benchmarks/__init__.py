"""The benchmarks: one script per question, grouped by what they measure.

Run each from the repository root as a module; `python -m benchmarks` lists them all:

    .venv/bin/python -m benchmarks                                  # the scripts, one line each
    .venv/bin/python -m benchmarks.star.protocol_overhead --help    # one script's options

    engines/  one engine on this machine: backends x precisions, the torch engine's costs, the AMX fix
    speculative/ speculative decoding on one machine and against the peers (local, llama.cpp's own, suffix)
    star/     StarSD: the two-device star, scaling to N targets, draft formats and switches, overhead
    sun/      SUN / QSUN: accuracy, shared vs isolated decode pools, int4 decoder speed
    device/   one report per device profile, and the memory planner against measured peak RSS
    faults/   network and process faults and attacks on a live star in namespaces (root)
    load/     N sessions on one draft service and one SUN decoder: fairness, memory, refusals
    lib/      what the scripts share and the processes they start (no scripts)

Each run writes benchmarks/results/<script>/<variant>.{json,md,png}; benchmarks/results/README.md
names the figure of record for each question, its machine and its command. The code the
benchmarks share with the tests (emulated targets, load drivers, namespace stars) is `harness/`.
Nothing in edge/, server/, export/ or devices/ imports benchmarks (pyproject.toml's contracts).
"""
