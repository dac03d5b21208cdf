"""The peer at its best: llama.cpp's own C++ speculation vs the StarSD star, same pair, prompts, cores.

llama.cpp's tools are built from the source vendored in the llama-cpp-python release the kit
uses (scripts/llama_tools.sh: same ggml, -march=native, AMX off), and run as their users run them:

* target-only: `llama-completion` (greedy, 1 thread, pinned to core 0);
* draft model: `llama-speculative-simple -m TARGET -md DRAFT --spec-type draft-simple --spec-draft-n-max γ`, the target's
  thread on core 0 and the draft's on core 1 (-C / -Cd, strict), the same cores the star uses; and
  tuned for a cheap verify: `--spec-draft-n-max 8 --spec-draft-p-min 0.75` (its defaults are 3 and 0);
* model-free: `llama-speculative-simple --spec-type ngram-mod` (and ngram-simple), core 0.

Ours, in the same run: benchmarks/star/starsd_two_device.py (the target on core 0 in this process's
child, the hub + draft service on core 1, Mosquitto) on the same prompts. Each system's speedup is
over its own target-only; the target-only tok/s of both are compared directly (same backend).

  python -m benchmarks.speculative.native_spec [--mtbench 4] [--code 4] [--new 64] [--gammas 3] [--rounds 3]
Run from the repository root. Writes benchmarks/results/native_spec/<variant>.{json,md,png}
(--out; default: the variant `default`; ours' own run: --ours-out).
"""
from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks.lib.results import ROOT, result_stem
from export.target_format import FORMATS, target_gguf

OUT = result_stem("native_spec")
PIN = ["-t", "1", "-tb", "1", "-C", "0x1", "--cpu-strict", "1"]
DRAFT_PIN = ["-td", "1", "-tbd", "1", "-Cd", "0x2", "--cpu-strict-draft", "1"]
DEEP = "draft_g8_pmin0.75"   # llama.cpp's draft model, deeper, with its confidence stop
COMMON = ["--temp", "0", "--top-k", "1", "--seed", "1", "-c", "2048"]


def tools() -> Path:
    """The bin directory of llama.cpp's tools, built on first use (minutes)."""
    p = subprocess.run(["bash", str(ROOT / "scripts" / "llama_tools.sh"), str(Path(sys.executable).parent)],
                       capture_output=True, text=True)
    if p.returncode != 0:
        sys.exit(f"building llama.cpp's tools failed:\n{p.stderr[-2000:]}")
    return Path(p.stdout.strip().splitlines()[-1])


def run_tool(cmd: list, timeout: float = 900) -> str:
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if p.returncode != 0:
        raise RuntimeError(f"{Path(cmd[0]).name} failed ({p.returncode}): {p.stderr[-800:]}")
    return p.stdout + p.stderr


def target_only(bin_dir: Path, target: Path, prompt_file: Path, new: int) -> dict:
    log = run_tool([str(bin_dir / "llama-completion"), "-m", str(target), "-f", str(prompt_file), "-n", str(new),
                    "-no-cnv", "--ignore-eos", *COMMON, *PIN])
    line = next((ln for ln in log.splitlines() if "eval time =" in ln and "prompt eval" not in ln), "")
    m = re.search(r"eval time =\s*([\d.]+) ms /\s*(\d+) runs.*?([\d.]+) tokens per second", line)
    if not m:
        raise RuntimeError("no eval timing in llama-completion's output:\n" + log[-800:])
    return {"tok_s": float(m.group(3)), "tokens": int(m.group(2)) + 1}


def speculative(bin_dir: Path, target: Path, prompt_file: Path, new: int, draft=None, gamma=3,
                spec_type=None, p_min=None) -> dict:
    cmd = [str(bin_dir / "llama-speculative-simple"), "-m", str(target), "-f", str(prompt_file), "-n", str(new),
           "--ignore-eos", *COMMON, *PIN, "--spec-draft-n-max", str(gamma)]
    if draft is not None:
        cmd += ["-md", str(draft), *DRAFT_PIN, "--spec-type", "draft-simple"]
    if spec_type:
        cmd += ["--spec-type", spec_type]
    if p_min is not None:
        cmd += ["--spec-draft-p-min", str(p_min)]
    log = run_tool(cmd)
    m = re.search(r"decoded\s+(\d+) tokens in\s+([\d.]+) seconds, speed:\s+([\d.]+) t/s", log)
    acc = re.search(r"accept\s+=\s+([\d.]+)%", log)     # "-nan%" when nothing was drafted
    if not m:
        raise RuntimeError("no decode timing in llama-speculative-simple's output:\n" + log[-800:])
    return {"tok_s": float(m.group(3)), "tokens": int(m.group(1)),
            "acceptance": float(acc.group(1)) / 100 if acc else None}


def ours(args, work: Path) -> dict:
    """benchmarks/star/starsd_two_device.py on the same prompts (its own target-only alongside)."""
    cmd = [sys.executable, "-m", "benchmarks.star.starsd_two_device", "--target", args.target,
           "--draft", args.draft, "--mtbench", str(args.mtbench), "--code", str(args.code), "--new", str(args.new),
           "--rounds", str(args.rounds), "--gammas", args.gammas, "--out", str(args.ours_out or work / "ours"),
           "--target-format", args.target_format, "--draft-format", args.draft_format]
    subprocess.run(cmd, check=True, timeout=7200, cwd=ROOT)
    return json.loads(Path(str(args.ours_out or work / "ours") + ".json").read_text())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", default="qwen2.5-coder-1.5b")
    ap.add_argument("--draft", default="qwen2.5-coder-0.5b")
    ap.add_argument("--mtbench", type=int, default=4)
    ap.add_argument("--code", type=int, default=4)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--gammas", default="3", help="γ for both systems (ours also accepts auto)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--no-ours", action="store_true", help="only llama.cpp's tools")
    ap.add_argument("--target-format", default="native", choices=FORMATS,
                    help="the target's GGUF as fetched or the same weights as F16 / Q8_0, for every system "
                         "(export/target_format.py)")
    ap.add_argument("--draft-format", default="native", choices=FORMATS,
                    help="the draft's GGUF, for every system (Q4_0: the cheaper draft on x86)")
    ap.add_argument("--out", type=Path, default=OUT, help="results path without suffix")
    ap.add_argument("--ours-out", type=Path, default=None,
                    help="keep ours' run as starsd_two_device results here (path without suffix)")
    args = ap.parse_args()
    from benchmarks.lib.datasets import code_prompts, mtbench_first_turns
    from edge.telemetry.cpu_info import cpu_name
    from edge.model.tokenizer import Tokenizer
    bin_dir = tools()
    target, draft = target_gguf(args.target, args.target_format), target_gguf(args.draft, args.draft_format)
    tok = Tokenizer.from_gguf(target)
    prompts = [("mtbench", p) for p in mtbench_first_turns(args.mtbench)] + \
              [("code", p) for p in code_prompts(args.code)]
    native_gammas = [int(g) for g in args.gammas.split(",") if g.isdigit()] or [3]
    rows = []
    with tempfile.TemporaryDirectory() as d:
        work = Path(d)
        for i, (kind, text) in enumerate(prompts):
            pf = work / f"p{i}.txt"
            pf.write_text(tok.apply_chat_template([{"role": "user", "content": text}]))
            modes = {"alone": lambda: target_only(bin_dir, target, pf, args.new)}
            for g in native_gammas:
                modes[f"draft_g{g}"] = lambda g=g: speculative(bin_dir, target, pf, args.new, draft=draft, gamma=g)
            # tuned for a cheap verify: deeper, with a confidence stop as ours has (defaults: 3, 0.0)
            modes[DEEP] = lambda: speculative(bin_dir, target, pf, args.new, draft=draft, gamma=8, p_min=0.75)
            modes["ngram_mod"] = lambda: speculative(bin_dir, target, pf, args.new, gamma=max(native_gammas),
                                                     spec_type="ngram-mod")
            runs = {m: [] for m in modes}
            for _ in range(args.rounds):              # interleaved: a load burst hits every mode alike
                for m, f in modes.items():
                    try:
                        runs[m].append(f())
                    except RuntimeError as e:
                        runs[m].append({"error": str(e)[:300]})
            row = {"kind": kind, "prompt": text[:60]}
            for m, rs in runs.items():
                ok = [r for r in rs if "error" not in r]
                row[m] = ({"tok_s": statistics.median(r["tok_s"] for r in ok),
                           "acceptance": ok[0].get("acceptance")} if ok else {"error": rs[0]["error"]})
            base = row["alone"].get("tok_s")
            for m in modes:
                if m != "alone" and "tok_s" in row[m] and base:
                    row[m]["speedup"] = row[m]["tok_s"] / base
            rows.append(row)
            print(json.dumps(row), flush=True)
        res = {"cpu": cpu_name(), "target": args.target, "target_format": args.target_format,
               "draft": args.draft, "draft_format": args.draft_format, "new_tokens": args.new,
               "rounds": args.rounds, "tools": str(bin_dir), "native": rows}
        if not args.no_ours:
            res["ours"] = ours(args, work)
    write(res, native_gammas, args.out)


def _median(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def write(res: dict, gammas: list, out: Path = OUT) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(res, indent=1))
    modes = [f"draft_g{g}" for g in gammas] + ([DEEP] if DEEP in res["native"][0] else []) + ["ngram_mod"]
    fmt = "" if res.get("target_format", "native") == "native" else f" (as {res['target_format']})"
    dfmt = "" if res.get("draft_format", "native") == "native" else f" (as {res['draft_format']})"
    lines = [f"# llama.cpp's own speculation vs the StarSD star: {res['target']}{fmt} target, {res['draft']}{dfmt} draft, "
             f"{res['new_tokens']} greedy tokens, medians of {res['rounds']}", "",
             f"CPU: {res['cpu']}. Target thread on core 0 in every system; llama.cpp's draft thread on core 1 "
             "(-Cd); ours: the hub + draft service on core 1.", "",
             "| set | prompt | llama.cpp alone tok/s | " + " | ".join(f"{m} tok/s | ×" for m in modes) + " |",
             "|" + "---|" * (3 + 2 * len(modes))]
    for r in res["native"]:
        cells = [r["kind"], r["prompt"].replace("|", "/").replace("\n", " "),
                 f"{r['alone'].get('tok_s', float('nan')):.2f}"]
        for m in modes:
            x = r[m]
            cells += ([f"{x['tok_s']:.2f}", f"{x.get('speedup', float('nan')):.2f}"] if "tok_s" in x
                      else ["failed", x["error"][:40]])
        lines.append("| " + " | ".join(cells) + " |")
    summary = {}
    for kind in ("mtbench", "code"):
        rs = [r for r in res["native"] if r["kind"] == kind]
        summary[kind] = {m: _median(r[m].get("speedup") for r in rs) for m in modes}
        summary[kind]["alone_tok_s"] = _median(r["alone"].get("tok_s") for r in rs)
    o = res.get("ours")
    if o:
        gs = [k[len("median_speedup_"):] for k in o if k.startswith("median_speedup_")]
        for kind in ("mtbench", "code"):
            rs = [r for r in o["rows"] if r["kind"] == kind]
            summary[kind]["ours_alone_tok_s"] = _median(r["alone_tok_s"] for r in rs)
            for g in gs:
                summary[kind][f"ours_{g}"] = _median(r[g]["speedup"] for r in rs)
    res["summary"] = summary
    out.with_suffix(".json").write_text(json.dumps(res, indent=1))
    lines += ["", "## Medians per set (speedup over each system's own target-only)", "",
              "| set | llama.cpp alone tok/s | ours alone tok/s | " + " | ".join(
                  [f"llama.cpp {m}" for m in modes] + [k for k in summary["code"] if k.startswith("ours_g")]) + " |",
              "|" + "---|" * (3 + len(modes) + len([k for k in summary["code"] if k.startswith("ours_g")]))]
    num = (lambda x: "-" if x is None else f"{x:.2f}")
    for kind, s in summary.items():
        ours_cols = [k for k in s if k.startswith("ours_g")]
        lines.append(f"| {kind} | {num(s['alone_tok_s'])} | {num(s.get('ours_alone_tok_s'))} | "
                     + " | ".join(num(s[m]) for m in modes + ours_cols) + " |")
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(8, 3.5))
    cols = modes + [k for k in summary["code"] if k.startswith("ours_g")]
    for j, kind in enumerate(("mtbench", "code")):
        ax.bar([i + 0.4 * j for i in range(len(cols))], [summary[kind][c] or 0 for c in cols], 0.4, label=kind)
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xticks([i + 0.2 for i in range(len(cols))], cols, fontsize=8)
    ax.set_ylabel("speedup over own target-only")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out.with_suffix(".png"), dpi=120)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
