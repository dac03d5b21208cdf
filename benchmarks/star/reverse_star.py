"""The reverse star: N drafting devices around ONE hub verifying in batch, against the hub serving the
same N clients by plain batched decoding, and against the planner's prediction -- ratios in one run.

Hub: Qwen2.5-Coder-1.5B stored as F16 (memory-bound: it stands in for a GPU hub), llama.cpp (or
torch in bfloat16: --hub-backend torch), one thread, in the real `edge-hub serve --verify-model` (Mosquitto, the verify service: every pending
session's verify in one llama_decode) pinned to core 1. Devices: N = 1, 2, 4, 8 drafting devices
in this process pinned to core 0, each the real device code over its own MQTT link
(benchmarks/lib/reverse_star_parts.py). N = 1 is a real device drafting with Qwen2.5-Coder-0.5B
Q4_0 on core 0 (the calibration pass: its proposals and step time are recorded); for every N the
devices replay those proposals from the same contexts and take the measured step time per token
(emulated devices with the real draft's step cost and real acceptance). Greedy, fixed γ, code and
MT-bench prompts.

Baseline (a), same core, same file, same run: the hub decoding N sequences by one batched call of
N tokens a step (benchmarks/lib/reverse_baseline_worker.py, after the hub has stopped), the same
prompts in the same groups. Both rates EXCLUDE the prompts' prefill: the baseline times its decode
steps only; the reverse star runs job k of every device together and counts each generation from
the last first answer of its group (every prompt of the group prefilled at the hub by then) to its
end. Prediction
(b): server/reverse_planner.py fed with that worker's measured call times by tokens, the device's
measured draft step, the measured round trip less the hub's call, and the acceptance of N = 1 --
both its steady loop (rounds only) and server/reverse_schedule.py's generations (each device's
prompts, the hub's prefill of each, each prompt's own acceptance from N = 1, run and timed as here),
both with the verify service's joining (edge/star/verify_join.py).
Medians over --rounds.

    python -m benchmarks.star.reverse_star --quick        # N = 1, 2; 24 tokens; one round
    python -m benchmarks.star.reverse_star                # N = 1, 2, 4, 8; 48 tokens; 3 rounds
Writes benchmarks/results/reverse_star/<variant>.{json,md,png} (--out).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

from benchmarks.lib.results import result_stem
from benchmarks.lib.reverse_star_parts import (BIN, ROOT, HubProcess, RecordingDrafter, ReplayDrafter, alpha_of,
                                               jobs_of, log, make_device, pin, prompt_alphas, run_devices)

TARGET, DRAFT = "qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b"


def args_of(argv=None):
    ap = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    ap.add_argument("--ns", default=None, help="numbers of drafting devices to sweep, comma-separated "
                    "(default 1,2,4,8; --quick: 1,2)")
    ap.add_argument("--gamma", type=int, default=4, help="tokens each device drafts a round")
    ap.add_argument("--new", type=int, default=48, help="greedy tokens per device")
    ap.add_argument("--code", type=int, default=2, help="HumanEval prompts")
    ap.add_argument("--mtbench", type=int, default=2, help="MT-bench first turns")
    ap.add_argument("--rounds", type=int, default=3, help="repeats of each N (medians)")
    ap.add_argument("--reps", type=int, default=3, help="repeats of each hub call timed for the planner's table")
    ap.add_argument("--target-format", default="F16", help="the hub target's GGUF type (F16: memory-bound, a GPU hub's stand-in)")
    ap.add_argument("--hub-backend", default="llamacpp", choices=("llamacpp", "torch"),
                    help="the hub target's engine (torch: the GGUF's weights in --hub-dtype; bfloat16 matmuls "
                         "run on AMX tiles where the CPU has them: a verify call nearly as cheap as a step)")
    ap.add_argument("--hub-dtype", default="bfloat16", help="the torch hub's weights (--hub-backend torch)")
    ap.add_argument("--draft-format", default="Q4_0", help="the devices' draft GGUF type")
    ap.add_argument("--no-pin", action="store_true", help="do not pin the hub to core 1 and the devices to core 0")
    ap.add_argument("--quick", action="store_true", help="a smoke run: N = 1, 2, 24 tokens, one prompt of each kind, one round")
    ap.add_argument("--out", default=None, help="results path without suffix (default: benchmarks/results/reverse_star/default; --quick: quick)")
    a = ap.parse_args(argv)
    if a.quick:
        a.ns, a.new, a.rounds, a.code, a.mtbench, a.reps = a.ns or "1,2", 24, 1, 1, 1, 3
    a.ns = a.ns or "1,2,4,8"
    return a


def prompts_of(tok, a) -> list:
    from benchmarks.lib.datasets import code_prompts, mtbench_first_turns
    texts = code_prompts(a.code) + mtbench_first_turns(a.mtbench)
    return [tok.encode(tok.apply_chat_template([{"role": "user", "content": t}]), add_special=False) for t in texts]


def machine() -> dict:
    from edge.telemetry.cpu_info import cpu_name
    return {"cpu": cpu_name(), "cpus": os.cpu_count(), "host": platform.node(), "loadavg_start": os.getloadavg()}


def sweep(a, hub, fp, vocab, prompts, stop_ids, draft) -> tuple:
    """The calibration pass (N = 1, the real draft), then the emulated N points, `rounds` times."""
    trace, step_s, misses = {}, [], []
    dev = make_device(hub.url, "real-0", fp, vocab, a.gamma, lambda p, k: RecordingDrafter(draft, trace, step_s))
    real = run_devices([dev], [prompts], a.new, stop_ids)       # every prompt's contexts recorded
    dev.close()
    step = statistics.median(step_s)
    log(f"real device: draft step {1e3 * step:.1f} ms, {real['tokens']} tokens, {real['hub_tps']:.2f} tok/s")
    ns = [int(x) for x in a.ns.split(",")]
    points = {n: [] for n in ns}
    before: dict = {}                                   # the hub's calls so far (its stats are cumulative)
    for rnd in range(a.rounds):
        for n in ns:
            devs = [make_device(hub.url, f"emu-{n}-{i}-{rnd}", fp, vocab, a.gamma,
                                lambda p, k: ReplayDrafter(trace, step, misses)) for i in range(n)]
            pt = run_devices(devs, jobs_of(prompts, n), a.new, stop_ids)
            for d in devs:
                d.close()
            time.sleep(1.5)                              # the hub's stats line after the last answer (every 1 s)
            pt["hub_stats"] = hub.verify_stats()
            now = pt["hub_stats"].get("calls", {})
            pt["hub_calls"], before = calls_since(before, now), now
            points[n].append(pt)
            log(f"round {rnd + 1}, N={n}: hub {pt['hub_tps']:.2f} tok/s, per device {pt['per_device_tps']:.2f}, "
                f"{pt['tokens_per_round']:.2f} tokens a round")
    return real, step, points, misses


def calls_since(before: dict, now: dict) -> dict:
    """The serving hub's batched verify calls between two of its stats lines: {sessions: [calls, mean ms]}."""
    out = {}
    for b, (count, ms) in now.items():
        c0, ms0 = before.get(b, (0, 0.0))
        if count > c0:
            out[str(b)] = [count - c0, (count * ms - c0 * ms0) / (count - c0)]
    return out


def baseline(a, target: Path, prompts: list, work: Path) -> dict:
    pf = work / "prompts.json"
    pf.write_text(json.dumps(prompts))
    cmd = [str(BIN / "python"), "-m", "benchmarks.lib.reverse_baseline_worker", "--target", str(target),
           "--prompts", str(pf), "--ns", a.ns, "--new", str(a.new), "--ks", f"1,2,{a.gamma},{a.gamma + 1}",
           "--reps", str(a.reps), "--backend", a.hub_backend, "--dtype", a.hub_dtype]
    if not a.no_pin:
        cmd = ["taskset", "-c", "1"] + cmd
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
    if out.returncode:
        raise SystemExit(f"the baseline worker failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout)


def main(argv=None) -> None:
    from edge.engines.loader import open_model
    from export.target_format import target_gguf
    from server.broker import find_free_port
    from server.reverse_planner import ReverseInputs, simulate_reverse
    from server.reverse_schedule import Job, simulate_schedule

    a = args_of(argv)
    mach = machine()
    t_begin = time.time()
    target, draft_path = target_gguf(TARGET, a.target_format), target_gguf(DRAFT, a.draft_format)
    pin(None if a.no_pin else 0)                       # before the draft loads: its threads inherit it
    draft, tok = open_model(str(draft_path), backend="llamacpp", threads=1, max_len=1024)
    prompts, stop_ids = prompts_of(tok, a), tuple(tok.eos_ids)
    work = Path(tempfile.mkdtemp(prefix="reverse-star-", dir=ROOT / "runs" if (ROOT / "runs").is_dir() else None))
    hub = HubProcess(target, find_free_port(), None if a.no_pin else 1, work, max_sessions=2 * max(
        int(x) for x in a.ns.split(",")) + 4, backend=a.hub_backend, dtype=a.hub_dtype)
    try:
        hub.wait_up()
        real, step, points, misses = sweep(a, hub, tok.fingerprint(), draft.vocab_size, prompts, stop_ids, draft)
    finally:
        hub.stop()
    base = baseline(a, target, prompts, work)
    alpha = alpha_of([real], a.gamma)
    call = {int(k): v for k, v in base["call_ms"].items()}
    # the round trip less the hub's call, from N = 1's first replayed round (the calibration pass is
    # the hub's warm-up: its first calls page the target's weights in, and its round trips ran long)
    warm = points[1][0] if 1 in points else real
    inp = ReverseInputs(call, 1e3 * step, 0.0, alpha)
    inp.rtt_ms = max(0.5, warm["rtt_ms_p50"] - inp.hub_ms(a.gamma + 1))
    alphas = prompt_alphas(real, a.gamma)
    rows = []
    for n, pts in points.items():
        plain = next(p for p in base["plain"] if p["n"] == n)
        pred = simulate_reverse(inp, n, a.gamma)
        jobs = [[Job(len(p), a.new, alphas.get(len(p))) for p in js] for js in jobs_of(prompts, n)]
        sched = simulate_schedule(inp, jobs, a.gamma, together=True)
        hub_tps = statistics.median(p["hub_tps"] for p in pts)
        rows.append({"n": n, "hub_tps": hub_tps, "per_device_tps": statistics.median(p["per_device_tps"] for p in pts),
                     "plain_hub_tps": plain["hub_tps"], "plain_per_client_tps": plain["per_client_tps"],
                     "vs_plain": hub_tps / plain["hub_tps"], "pred_hub_tps": pred.hub_tps,
                     "pred_per_device_tps": pred.per_device_tps, "pred_error": pred.hub_tps / hub_tps - 1,
                     "sched_hub_tps": sched.hub_tps, "sched_per_device_tps": sched.per_device_tps,
                     "sched_error": sched.hub_tps / hub_tps - 1, "sched_prefill_s": sched.prefill_s,
                     "tokens_per_round": statistics.median(p["tokens_per_round"] for p in pts)})
    mach["loadavg_end"] = os.getloadavg()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    out = {"machine": mach, "config": vars(a), "commit": commit, "target": str(target.name), "draft": str(draft_path.name),
           "draft_step_ms": 1e3 * step, "alpha": alpha, "prompt_alphas": alphas, "rtt_ms": inp.rtt_ms,
           "call_ms": base["call_ms"],
           "plain": base["plain"], "real": real, "points": {str(n): p for n, p in points.items()},
           "trace_misses": len(misses), "rows": rows, "wall_s": time.time() - t_begin}
    stem = Path(a.out) if a.out else result_stem("reverse_star", "quick" if a.quick else "default")
    from benchmarks.lib.reverse_star_report import write_outputs
    write_outputs(stem, out)
    log(f"wrote {stem}.json/.md/.png")


if __name__ == "__main__":
    main()
