"""StarSD measured as a star on this machine: cores as devices.

The target "device" is core 0: this process, pinned there, runs the 1.5B target on llama.cpp
with one thread -- target-only and StarSD side by side, prompt by prompt. The hub and a remote
draft service (`edge-agent run --role draft -b llamacpp`, the 0.5B, one thread) are real
processes pinned to core 1, over a real Mosquitto. The draft's compute leaves the target's
core; memory bandwidth is still shared between the two cores (a real second device would not
share it), so this understates what a separate device gives.

Greedy on llama.cpp: a verify over k tokens and a one-token step use different kernels, so
texts may split at a near-tie; each split is reported with its position and the target's
top-1 vs top-2 logit margin there. The layout and the per-prompt measurement are
server/demos/two_device.py's (`edge-hub demo` shows the same comparison).

  python -m benchmarks.star.starsd_two_device [--mtbench 4] [--code 4] [--bfcl N --edits N --multiturn N]
      [--new 64] [--gammas 3,auto] [--rounds 3] [--target-format F16] [--drafter model|suffix|hybrid]

A draft that learns from every session (`--drafter suffix|hybrid`) runs each prompt once a pass
through the star; `--rounds` passes, each with a fresh hub and draft service, give the medians.

`--gammas` takes fixed γ values and `auto` (γ 0..8 chosen each round, edge/speculative/remote_gamma.py;
`auto:N` for 0..N); `auto-asked` is γ=auto pricing a round as if every draft asked were sent
(the model before the confidence stop's sent count was priced), side by side for A/B.
Run from the repository root. Writes benchmarks/results/starsd_two_device/<variant>.{json,md,png}
(--out; default: the variant `default`); the report: benchmarks/lib/two_device_report.py.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
from pathlib import Path

from benchmarks.lib.results import result_stem
from benchmarks.lib.two_device_report import merge_passes, write
from export.target_format import FORMATS, target_gguf


def args_of(argv=None):
    """The options, with a learning draft's passes: a suffix tree learns every session's output, so
    a second run of a prompt would replay its own first. A learning draft runs each prompt once per
    pass, and each of --rounds passes starts a fresh hub and draft service (whose tree holds the
    earlier prompts' outputs, never this one's)."""
    from server.demos.two_device import parse_modes
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", default="qwen2.5-coder-1.5b")
    ap.add_argument("--draft", default="qwen2.5-coder-0.5b")
    ap.add_argument("--target-format", default="native", choices=FORMATS,
                    help="the target's GGUF as fetched (Q4_K_M: compute-bound on one core here) or the "
                         "same weights as F16 / Q8_0 (memory-bound, a Jetson GPU's regime); "
                         "export/target_format.py")
    ap.add_argument("--draft-format", default="native", choices=FORMATS,
                    help="the draft's GGUF storage format: Q4_0 is the cheaper draft on an x86 core "
                         "(benchmarks/star/draft_formats.py)")
    ap.add_argument("--mtbench", type=int, default=4, help="MT-bench first turns")
    ap.add_argument("--code", type=int, default=4, help="HumanEval prompts")
    ap.add_argument("--bfcl", type=int, default=0, help="BFCL function-calling cases (text repeats: the schema)")
    ap.add_argument("--edits", type=int, default=0, help="code edits with the function in the prompt")
    ap.add_argument("--multiturn", type=int, default=0, help="MT-bench second turns (the first answered "
                                                            "by the target itself)")
    ap.add_argument("--turn1-tokens", type=int, default=96, help="multiturn: length of the first answer")
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--gammas", default="3", help="γ modes, comma-separated: integers and/or auto[:N]; "
                    "auto-asked: γ=auto pricing rounds as if every draft asked were sent (the older model, A/B)")
    ap.add_argument("--no-ahead", dest="ahead", action="store_false",
                    help="no draft-ahead in the draft service's idle time (edge-agent run's default is on)")
    ap.add_argument("--rounds", type=int, default=3,
                    help="repeats per prompt and mode (medians); a learning --drafter: passes, each with a "
                         "fresh hub and draft service")
    ap.add_argument("--out", type=Path, default=result_stem("starsd_two_device"),
                    help="results path without suffix (a smoke run: elsewhere)")
    ap.add_argument("--drafter", default="model", choices=["model", "suffix", "hybrid"],
                    help="the remote draft service's drafter (edge-agent run --drafter)")
    ap.add_argument("--draft-p-min", type=float, default=None,
                    help="the draft service's --draft-p-min (default: edge-agent run's; 0 drafts every γ)")
    ap.add_argument("--broker", default=None, metavar="mqtt[s]://HOST:PORT",
                    help="a real hub elsewhere (its draft services draft): this process is the device")
    ap.add_argument("--tls-dir", default=None, help="with an mqtts:// --broker: ca.crt and this device's certificate")
    ap.add_argument("--client-id", default="dev0", help="this device's client id at --broker")
    args = ap.parse_args(argv)
    args.modes = parse_modes(args.gammas)
    learns = args.drafter != "model"
    args.passes = args.rounds if learns and not args.hub else 1
    args.star_rounds = 1 if learns else args.rounds
    if learns and len(args.modes) > 1:
        ap.error(f"--drafter {args.drafter} learns from every session: give one γ mode a run (--gammas auto), "
                 "or the later mode drafts from the earlier one's output of the same prompt")
    return args


def main(argv=None) -> None:
    args = args_of(argv)
    os.sched_setaffinity(0, {0})                    # this process is the target device
    from benchmarks.lib.datasets import code_prompts, mtbench_first_turns
    from edge.engines.loader import open_model
    from edge.wire.link import MqttLink
    from edge.star.hub_client import HubClient
    from edge.star.target import StarTarget
    from server.demos.two_device import RemoteStar, measure_prompt
    from server.mosquitto import MosquittoBroker

    modes, passes, learns = args.modes, args.passes, args.drafter != "model"
    gammas = [m[0] for m in modes]
    engine, tok = open_model(str(target_gguf(args.target, args.target_format)), backend="llamacpp",
                             threads=1, max_len=4096)
    chat = [("mtbench", p) for p in mtbench_first_turns(args.mtbench)] + [("code", p) for p in code_prompts(args.code)]
    prompts = [(kind, text, tok.encode(tok.apply_chat_template([{"role": "user", "content": text}])))
               for kind, text in chat] + repetitive_prompts(engine, tok, args)
    broker = None if args.hub else MosquittoBroker().start()
    logdir = args.out.parent / (args.out.name + "_logs.tmp")
    runs = []
    try:
        for n in range(passes):
            if args.hub:                    # the star is elsewhere: this device only verifies
                from edge.cli.broker_options import tls_files
                url, star_ctx = args.hub, contextlib.nullcontext()
                link = MqttLink(url, tls=tls_files(args.tls_dir, args.client_id, url))
                args.setup = f"this device's target (core 0) against the hub at {url}"
            else:
                url = broker.url
                star_ctx = RemoteStar(str(target_gguf(args.draft, args.draft_format)), logdir, core=1,
                                      broker_url=url, ahead=args.ahead,
                                      drafter=args.drafter, p_min=args.draft_p_min)
                link = MqttLink(url, client_id=f"{args.client_id}-pass{n}")
            with star_ctx:
                star = StarTarget(engine, HubClient(link.connect(10), args.client_id, tok.fingerprint(),
                                                    engine.vocab_size), gamma=max(m[1] for m in modes))
                warm = tok.encode(tok.apply_chat_template([{"role": "user", "content": "hello"}]))
                star.generate(warm, 8)              # the first session pays joins and the draft's warm-up
                if any(m[2] for m in modes):
                    star.calibrate()                # the verify-cost curve auto uses, outside the timed runs
                rows = []
                for kind, text, ids in prompts:
                    row = {"kind": kind, "prompt": text[:60],
                           **measure_prompt(engine, star, ids, args.new, modes, 1 if learns else args.rounds,
                                            tok.eos_ids, star_rounds=args.star_rounds)}
                    row.pop("alone_tokens")
                    rows.append(row)
                    print(json.dumps(row), flush=True)
                runs.append(rows)
                star.hub.close()
                link.close()
    finally:
        if broker is not None:
            broker.close()
    rows = runs[0] if passes == 1 else [merge_passes(rs, gammas) for rs in zip(*runs)]
    write(rows, gammas, args)


def repetitive_prompts(engine, tok, args):
    """(kind, label, ids) of the workloads where text repeats (benchmarks/lib/repetitive_workloads.py),
    templated as benchmarks/speculative/suffix_draft.py does (tools in the template for BFCL)."""
    from benchmarks.lib.repetitive_workloads import prompts_of
    out = []
    for kind in ("bfcl", "edits", "multiturn"):
        n = getattr(args, kind)
        for ids in (prompts_of(kind, n, engine, tok, args) if n else []):
            last_user = tok.decode(ids, skip_special=True).rsplit("user\n", 1)[-1].rsplit("\nassistant", 1)[0]
            out.append((kind, last_user.strip(), ids))
    return out


if __name__ == "__main__":
    main()
