"""StarSD scaling: ONE real draft service feeding N targets over a real MQTT broker.

The draft is real: Qwen2.5-Coder-0.5B-Instruct Q4_K_M in the llama.cpp engine
(batched `step` = one llama_decode over all sessions; --draft-backend torch
for the torch engine), inside the real hub (server/hub.py) and draft service
(edge/star/draft_service.py). The N targets are EMULATED remote devices
(harness/emulated_target.py) in their own process, running the real target
code over the real broker: each one's step time and verify cost vs k come from
a device profile (default jetson-orin-nano-8gb running Qwen2.5-Coder-1.5B
Q4_K_M), its network delay from --net-rtt-ms, its acceptance from a measured
alpha. Baselines in the same run: target-only and N co-located pairs (each
device with its own draft, emulated on the same profile: N x the draft memory).
Optionally a real-target point (the 1.5B on llama.cpp on this machine).

Per N: system and per-target tokens/s, draft busy ratio, T_idle, per-token
latency (round time / tokens of the round) p50/p99/variance, overhead = draft
round trip - DraftResponse.compute_us - emulated network. The planner
(server/planner.py) is fed with the draft service's MEASURED time per batch
size and predicts the same curves; the plot overlays both and marks N_full.

    python -m benchmarks.star.starsd_scaling --quick      # ~3-5 min on a quiet 2-core machine
    python -m benchmarks.star.starsd_scaling              # ~12-20 min
Run from the repository root. Writes benchmarks/results/starsd_scaling/<variant>.{json,png,md}
(--out; default: the variant `default`). The sweep's parts: benchmarks/lib/scaling_sweep.py.
"""
from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path

from benchmarks.lib.scaling_sweep import (DATA_ALPHA, DRAFT, TARGET, args_of, base_spec, load_draft, log,
                                          measure_alpha, measure_service, mtbench_prompts, run_point,
                                          set_threads, stretch)
from edge.model.fetch import model_path
from export.target_format import target_gguf
from harness.emulated_target import DeviceTiming


def alpha_of(a, draft, tok, prompts) -> dict:
    """The emulated targets' acceptance: measured against the real 1.5B, docs/models.md's, or given."""
    if a.alpha == "measure":
        return measure_alpha(draft, tok, prompts, a.alpha_prompts, a.alpha_tokens, a.draft_threads)
    if a.alpha == "data":
        return {"alpha": DATA_ALPHA, "source": "docs/models.md: measured 0.5B/1.5B greedy agreement 0.64-0.72"}
    return {"alpha": float(a.alpha), "source": "given on the command line"}


def report_of(a, timing, alpha_info: dict, d_of_b: dict) -> dict:
    """The report's inputs (options, acceptance, emulated device, the draft's measured time per batch
    size and memory), with empty lists the sweep fills."""
    return {"config": {k: v for k, v in vars(a).items() if k != "verify"}, "alpha": alpha_info,
            "timing": {"profile": a.profile, "target_step_ms": timing.target_step_ms,
                       "draft_step_on_device_ms": timing.draft_step_ms, "net_rtt_ms": timing.net_rtt_ms,
                       "verify_cost": {k: timing.verify_cost(k) for k in range(1, a.gamma + 2)},
                       "source": timing.source, "label": a.target_label},
            "service_ms": {str(b): 1e3 * d for b, d in d_of_b.items()}, "points": [], "baselines": {},
            "draft_mb": target_gguf(DRAFT, a.draft_format).stat().st_size / 1e6 if a.draft_backend == "llamacpp"
            else model_path(DRAFT).stat().st_size / 1e6,
            "overhead": {}, "real": []}


def _scaling_points(a, point, hub, bname: str, d_of_b: dict, r_ms: float, work: Path) -> list:
    """StarSD with N emulated targets, each N of --ns, its window stretched to the batch's pace."""
    points = []
    for n in a.ns:
        spec = stretch(point("star", n), 1e3 * d_of_b.get(n, max(d_of_b.values())), r_ms, a)
        log(f"StarSD N={n} on {bname}: window {spec['seconds']:.0f} s")
        p = run_point(spec, hub, work)
        p["broker"] = bname
        points.append(p)
        log(f"  system {p['system_tps']:.1f} tok/s, per target {p['per_target_tps_mean']:.2f}, "
            f"busy {p.get('busy_ratio', 0):.0%}, batch {p.get('mean_batch', 0):.1f}, "
            f"overhead {p.get('overhead_median_ms', float('nan')):.2f} ms"
            + (f", ERRORS {p['errors'][:2]}" if p["errors"] else ""))
    return points


def _real_target_points(a, point, hub, draft, tok, work: Path) -> list:
    """--real-targets: N real 1.5B targets through the star and alone (the draft at 1 thread meanwhile)."""
    points = []
    if a.real_targets:
        set_threads(draft, 1)        # draft + real targets share the cores: 1 thread each
    for n in a.real_targets:
        real = {"model": str(model_path(TARGET)), "max_len": 2048, "threads": 1}
        for mode in ("star", "alone"):
            spec = point(mode, n, real)
            spec["stop_ids"] = sorted(tok.eos_ids)
            log(f"real {TARGET} targets, N={n}, {mode}")
            p = run_point(spec, hub if mode == "star" else None, work)
            points.append(p)
            log(f"  system {p['system_tps']:.2f} tok/s, acceptance {p['acceptance']}")
    set_threads(draft, a.draft_threads)
    return points


def main(argv=None) -> None:
    from edge.star.draft_service import DraftLimits
    from server.broker import EmbeddedBroker, MosquittoBroker
    from server.hub import Hub
    from benchmarks.lib.starsd_report import planner_predictions, write_outputs

    a = args_of(argv, __doc__.split("\n")[0])
    if a.pin:                  # before the draft loads: llama.cpp's threads inherit this affinity
        os.sched_setaffinity(0, {1})
    t_begin = time.time()
    load0 = os.getloadavg()
    timing = DeviceTiming.from_profile(a.profile, a.net_rtt_ms, a.time_scale, a.verify, a.target_step_ms)
    log(f"emulated device {a.profile}: target step {timing.target_step_ms:.1f} ms, verify cost "
        f"k={a.gamma + 1}: {timing.verify_cost(a.gamma + 1):.2f}, device draft step {timing.draft_step_ms:.1f} ms")
    draft, tok = load_draft(a.draft_backend, a.draft_threads, slots=2 * max(a.ns) + 4, max_len=1536,
                            fmt=a.draft_format)
    fp, vocab = tok.fingerprint(), draft.vocab_size
    prompts = mtbench_prompts(tok, a.prompt_tokens)
    log(f"draft {DRAFT} on {a.draft_backend} ({a.draft_threads} threads); {len(prompts)} MT-bench prompts")
    alpha_info = alpha_of(a, draft, tok, prompts)
    alpha = alpha_info["alpha"]
    log(f"alpha = {alpha:.3f} ({alpha_info['source']})")
    d_of_b = measure_service(draft, a.ns, a.gamma, prompts, a.reps)
    r_ms = timing.call_ms(a.gamma + 1) + timing.net_rtt_ms
    out = report_of(a, timing, alpha_info, d_of_b)
    work = Path(tempfile.mkdtemp(prefix="starsd-"))
    # a long eviction timeout: the service measures silence from a session's last request, so a batch
    # slower than the timeout (a loaded machine, 32 prefills) would evict the sessions it just answered
    lim = DraftLimits(max_sessions=2 * max(a.ns) + 4, max_gamma=max(8, a.gamma), ahead=a.ahead,
                      coalesce=a.coalesce, join=a.join, evict_after_s=900)

    log("baselines: target-only and one co-located pair (emulated; N devices = N x one)")
    for mode in ("alone", "colocated"):
        spec = base_spec(a, mode, 1, prompts, timing, alpha, vocab, fp)
        spec["warmup_s"], spec["seconds"] = 1.0, max(8.0, a.seconds / 2)
        out["baselines"][mode] = run_point(spec, None, work)
        log(f"  {mode}: {out['baselines'][mode]['system_tps']:.1f} tok/s")

    brokers = [a.broker] + [b for b in a.overhead_brokers.split(",") if b and b != a.broker]
    for bname in brokers:
        broker = (MosquittoBroker() if bname == "mosquitto" else EmbeddedBroker()).start()
        hub = Hub(broker_url=broker.url, draft_engine=draft, tokenizer_fp=fp, limits=lim, hub_id="bench").start()
        try:
            point = lambda mode, n, real=None: base_spec(a, mode, n, prompts, timing, alpha, vocab, fp,  # noqa: E731
                                                         broker.url, real)
            if bname == a.broker:
                out["points"] += _scaling_points(a, point, hub, bname, d_of_b, r_ms, work)
                out["real"] += _real_target_points(a, point, hub, draft, tok, work)
            ospec = point("star", 1)
            ospec["timing"]["net_rtt_ms"] = 0.0
            ospec["seconds"] = max(8.0, a.seconds / 2)
            log(f"protocol overhead on {bname} (N=1, no emulated network)")
            p = run_point(ospec, hub, work)
            out["overhead"][bname] = {k: p.get(k) for k in ("overhead_median_ms", "overhead_p90_ms",
                                                            "overhead_samples", "system_tps")}
            log(f"  median {p.get('overhead_median_ms', float('nan')):.2f} ms over {p.get('overhead_samples')} answers")
        finally:
            hub.stop()
            hub.service.step()                        # free what the stopped loop left
            (broker.close if hasattr(broker, "close") else broker.stop)()

    out["planner"] = planner_predictions(out, a, timing, alpha)
    out["machine"] = {"cpus": os.cpu_count(), "loadavg_start": load0, "loadavg_end": os.getloadavg(),
                      "wall_s": time.time() - t_begin, "date": time.strftime("%Y-%m-%d %H:%M")}
    paths = write_outputs(out, Path(a.out))
    log("wrote " + ", ".join(str(p) for p in paths))


if __name__ == "__main__":
    main()
