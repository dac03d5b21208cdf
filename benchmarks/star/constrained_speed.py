"""Constrained decoding's speed through the star against unconstrained, same prompts, one run.

The star of benchmarks/star/starsd_two_device.py (the target on core 0 in this process, one
llama.cpp thread; the hub and a remote draft service, `edge-agent run --role draft -b llamacpp`,
one thread, pinned to core 1, over a real Mosquitto). Greedy, fixed γ. Each prompt asks for JSON
in words, and is generated four ways, the order rotating every repeat:

* `unconstrained`: no grammar (what the prompt alone gets);
* `json_object`: response_format {"type": "json_object"} (any JSON object);
* `json_schema`: response_format json_schema with the prompt's own schema;
* `json_schema_no_jump`: the same with jump-forward off (edge/speculative/jump_forward.py: no
  forced token is committed without a target call; forced tokens among the drafts still ride
  along γ uncounted, those after the last draft appended by the target);
* `json_schema_nothing_forced`: jump-forward off AND forced drafts counted against γ on both
  sides (the target cuts after γ drafts, the draft service -- told through a flag file its shim
  reads -- stops after γ tokens forced or not): constrained speculation with no use made of
  forced tokens, the "before" in the same run.

Per mode: decode tok/s (prefill excluded), acceptance (accepted / drafted: drafts the grammar left
a choice at), rounds (target calls after the prefill) and tokens a round, forced tokens (committed
without a call of their own), the rounds the target decoded alone and the draft's round trips, and the
grammar's cost per committed token on both sides:
the target's (its matcher's legal_drafts, mask_rows and sync, timed in this process) and the
draft service's (SessionGrammar.mask -- sync, mask, masked row -- timed inside the draft process,
which this script starts through a shim that wraps that method and writes its totals to a file).
Medians over --rounds repeats per prompt; the constrained / unconstrained tok/s ratio per prompt
and over all prompts, side by side. Every constrained output is checked (json.loads, jsonschema).

  python -m benchmarks.star.constrained_speed [--pair qwen|smollm2] [--prompts 4] [--new 64]
      [--rounds 3] [--gamma 3] [--target-format BF16] [--draft-format Q4_0] [--alone]

`--pair qwen` (default): Qwen2.5-Coder-1.5B target (stored as --target-format, the wide format
the star benchmarks use) with the 0.5B draft; `--pair smollm2`: SmolLM2-135M drafting for itself
(a fast target: where a mask's fixed cost weighs most). `--alone` also times target-only decoding
per mode (the grammar's cost without speculation). `--hostile` also times each hostile schema of
issue 44 through the star (benchmarks/lib/constrained_hostile.py: answered or refused, in < 5 s).
Run from the repository root. Writes
benchmarks/results/constrained_speed/<variant>.{json,md,png} (--out; default: the variant `default`).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import threading
import time
from pathlib import Path

from benchmarks.lib.results import result_stem
from benchmarks.lib.constrained_hostile import time_hostile
from benchmarks.lib.constrained_report import MODES, write

PAIRS = {"qwen": ("qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b"), "smollm2": ("smollm2-135m", "smollm2-135m")}

PROMPTS = [
    ("employee", "Describe a fictional employee as a JSON object with the keys name, age, department and "
                 "skills (a list of three strings). Reply with the JSON only.",
     {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                       "department": {"type": "string"},
                                       "skills": {"type": "array", "items": {"type": "string"}}},
      "required": ["name", "age", "department", "skills"], "additionalProperties": False}),
    ("weather", "Give a three-day weather forecast for Paris as JSON: the city and a list of days, each "
                "with a date, a condition and the high and low temperatures in Celsius. Reply with the JSON only.",
     {"type": "object", "properties": {
         "city": {"type": "string"},
         "days": {"type": "array", "items": {"type": "object", "properties": {
             "date": {"type": "string"}, "condition": {"type": "string"}, "high": {"type": "number"},
             "low": {"type": "number"}}, "required": ["date", "condition", "high", "low"],
             "additionalProperties": False}}},
      "required": ["city", "days"], "additionalProperties": False}),
    ("books", "List three classic novels as a JSON object with a key books: each book has a title, an "
              "author and the year it was published. Reply with the JSON only.",
     {"type": "object", "properties": {"books": {"type": "array", "items": {"type": "object", "properties": {
         "title": {"type": "string"}, "author": {"type": "string"}, "year": {"type": "integer"}},
         "required": ["title", "author", "year"], "additionalProperties": False}}},
      "required": ["books"], "additionalProperties": False}),
    ("tool_call", "A user says: 'Book a table for four at Luigi's tomorrow at 7pm.' Write the function "
                  "call as JSON with the keys name and arguments (restaurant, party_size, date, time). "
                  "Reply with the JSON only.",
     {"type": "object", "properties": {"name": {"type": "string"}, "arguments": {
         "type": "object", "properties": {"restaurant": {"type": "string"}, "party_size": {"type": "integer"},
                                          "date": {"type": "string"}, "time": {"type": "string"}},
         "required": ["restaurant", "party_size", "date", "time"], "additionalProperties": False}},
      "required": ["name", "arguments"], "additionalProperties": False}),
    ("product", "Write a JSON object for a product in an online shop: id, name, price, currency, in_stock "
                "(true or false) and tags (a list of strings). Reply with the JSON only.",
     {"type": "object", "properties": {"id": {"type": "string"}, "name": {"type": "string"},
                                       "price": {"type": "number"}, "currency": {"type": "string"},
                                       "in_stock": {"type": "boolean"},
                                       "tags": {"type": "array", "items": {"type": "string"}}},
      "required": ["id", "name", "price", "currency", "in_stock", "tags"], "additionalProperties": False}),
]


# ---- the grammar's time, on each side ----------------------------------------------------------

class Clock:
    """Seconds and calls accumulated by wrapped functions (thread-safe enough: one generation at a time)."""

    def __init__(self) -> None:
        self.s = {}          # wall seconds in the function (what the generation waits)
        self.cpu = {}        # this thread's CPU seconds in it (the rest: preempted, or waiting for the GIL)
        self.n = {}

    def wrap(self, name: str, fn):
        def timed(*a, **kw):
            t, c = time.perf_counter(), time.thread_time()
            try:
                return fn(*a, **kw)
            finally:
                self.s[name] = self.s.get(name, 0.0) + time.perf_counter() - t
                self.cpu[name] = self.cpu.get(name, 0.0) + time.thread_time() - c
                self.n[name] = self.n.get(name, 0) + 1
        return timed

    def total(self) -> float:
        return sum(self.s.values())

    def total_cpu(self) -> float:
        return sum(self.cpu.values())

    def snapshot(self) -> dict:
        return {"s": dict(self.s), "cpu": dict(self.cpu), "n": dict(self.n)}


def time_target_grammar() -> Clock:
    """Wrap what generate_speculative / generate_plain call on the grammar (this process: the target)."""
    import edge.speculative.generate as gen
    from edge.speculative.grammar import GrammarMatcher
    clock = Clock()
    for name in ("legal_drafts", "mask_rows", "grammar_matcher"):
        setattr(gen, name, clock.wrap(name, getattr(gen, name)))
    GrammarMatcher.sync = clock.wrap("sync", GrammarMatcher.sync)
    return clock


def draft_shim(stats_path: str, argv: list) -> None:
    """The draft service's process: edge-agent with SessionGrammar.mask (and grammar compiles) timed,
    the totals written to stats_path every 0.1 s."""
    import edge.star.draft_chain as dc
    import edge.star.draft_grammar as dg
    clock = Clock()
    dg.SessionGrammar.mask = clock.wrap("mask", dg.SessionGrammar.mask)
    dg.DraftGrammars._compile = clock.wrap("compile", dg.DraftGrammars._compile)
    taken, flag = dc.BatchItem.forced_taken, Path(stats_path + ".counted")

    def forced_taken(self):          # json_schema_nothing_forced: forced entries count against γ
        if not flag.exists():
            taken(self)
    dc.BatchItem.forced_taken = forced_taken

    def dump() -> None:
        tmp = stats_path + ".tmp"
        while True:
            Path(tmp).write_text(json.dumps(clock.snapshot()))
            os.replace(tmp, stats_path)
            time.sleep(0.1)
    threading.Thread(target=dump, daemon=True).start()
    from edge.cli.agent import main as agent_main
    sys.argv = ["edge-agent", *argv]
    agent_main()


def read_draft_clock(path: Path) -> dict:
    for _ in range(20):
        try:
            return json.loads(path.read_text())
        except (OSError, ValueError):
            time.sleep(0.05)
    return {"s": {}, "cpu": {}, "n": {}}


def timed_remote_star(draft: str, logdir: Path, url: str, stats: Path):
    """server/demos/two_device.RemoteStar whose draft process runs through draft_shim."""
    from server.demos.two_device import RemoteStar

    class TimedStar(RemoteStar):
        def _start(self, name, *argv):
            if name == "draft":                       # argv[0] is the edge-agent script
                argv = (sys.executable, "-m", "benchmarks.star.constrained_speed", "--draft-shim", str(stats),
                        "--", *argv[1:])
            return super()._start(name, *argv)
    return TimedStar(draft, logdir, core=1, broker_url=url)


# ---- the measurement ---------------------------------------------------------------------------

def check_json(text: str, schema) -> bool:
    try:
        obj = json.loads(text)
    except ValueError:
        return False
    if schema is None:
        return isinstance(obj, dict)
    import jsonschema
    try:
        jsonschema.validate(obj, schema)
        return True
    except jsonschema.ValidationError:
        return False


def counted_cut(matcher, drafts, qs, masks, g, cap):
    """jump_forward.with_forced as if no draft were forced: the first g drafts, nothing appended."""
    n = min(len(drafts), g)
    return drafts[:n], qs[:n], masks[:n + 1], [False] * n


@contextlib.contextmanager
def forced_mode(mode: str, stats: Path):
    """Jump-forward off (json_schema_no_jump), and forced drafts counted against γ too, here and
    in the draft process (json_schema_nothing_forced); this process is the target."""
    import edge.speculative.generate as gen
    real = gen.jump_forward, gen.with_forced
    flag = Path(str(stats) + ".counted") if stats else None
    try:
        if mode in ("json_schema_no_jump", "json_schema_nothing_forced"):
            gen.jump_forward = lambda run, matcher: 0
        if mode == "json_schema_nothing_forced":
            gen.with_forced = counted_cut
            if flag:
                flag.touch()
        yield
    finally:
        gen.jump_forward, gen.with_forced = real
        if flag and flag.exists():
            flag.unlink()


def one_run(fn, tok, clock: Clock, stats: Path, mode: str, schema, drafter=None) -> dict:
    t_before, c_before, d_before = clock.total(), clock.total_cpu(), read_draft_clock(stats) if stats else None
    with forced_mode(mode, stats):
        res = fn()
    target_s, target_cpu = clock.total() - t_before, clock.total_cpu() - c_before
    row = {"tok_s": res.tokens_per_s, "tokens": res.n_generated, "rounds": res.n_verify_calls,
           "tokens_per_round": res.tokens_per_verify, "acceptance": res.acceptance_rate,
           "drafted": res.n_drafted, "accepted": res.n_accepted, "decode_s": res.decode_s, "forced": res.n_forced,
           "target_grammar_ms_per_token": 1e3 * target_s / max(1, res.n_generated),
           "target_grammar_cpu_ms_per_token": 1e3 * target_cpu / max(1, res.n_generated),
           "finish": res.finish_reason, "ids": res.tokens}
    if drafter is not None:          # the star's: rounds decoded alone, the draft's round trips
        d = drafter()
        row.update(alone=d.stats.alone, late_used=d.stats.late_used,
                   rtt_ms=1e3 * statistics.median(d.stats.rtt_s) if d.stats.rtt_s else 0.0)
    if stats:
        time.sleep(0.3)                              # the shim writes every 0.1 s
        d_after = read_draft_clock(stats)
        ds = d_after["s"].get("mask", 0.0) - d_before["s"].get("mask", 0.0)
        dc = d_after["cpu"].get("mask", 0.0) - d_before["cpu"].get("mask", 0.0)
        dn = d_after["n"].get("mask", 0) - d_before["n"].get("mask", 0)
        row["draft_grammar_ms_per_token"] = 1e3 * ds / max(1, res.n_generated)
        row["draft_grammar_cpu_ms_per_token"] = 1e3 * dc / max(1, res.n_generated)
        row["draft_mask_cpu_us_each"] = 1e6 * dc / dn if dn else 0.0
        row["draft_masks"] = dn
        row["draft_mask_us_each"] = 1e6 * ds / dn if dn else 0.0
    text = tok.decode(res.tokens, skip_special=True)
    row["text"] = text
    if mode != "unconstrained":       # a text cut at --new is no whole JSON: not judged
        row["valid"] = None if res.finish_reason == "length" else check_json(
            text, None if mode == "json_object" else schema)
    return row


def summarise(runs: list) -> dict:
    keys = [k for k, v in runs[0].items() if isinstance(v, (int, float)) and not isinstance(v, bool)]
    out = {k: statistics.median(r[k] for r in runs) for k in keys}
    out["runs"] = len(runs)
    judged = [r["valid"] for r in runs if r.get("valid") is not None]
    out["valid"] = None if not judged else all(judged)     # None: every run was cut at --new
    out["same_text"] = len({tuple(r["ids"]) for r in runs}) == 1
    out["text"] = runs[-1]["text"]
    out["tok_s_all"] = [r["tok_s"] for r in runs]
    return out


def args_of(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pair", choices=sorted(PAIRS), default="qwen")
    ap.add_argument("--target-format", default=None, help="the target's GGUF format (default: qwen BF16/F16, "
                    "the star benchmarks' wide file; smollm2 native)")
    ap.add_argument("--draft-format", default=None, help="the draft's GGUF format (default: qwen Q4_0, smollm2 native)")
    ap.add_argument("--prompts", type=int, default=4, help=f"how many of the {len(PROMPTS)} JSON prompts")
    ap.add_argument("--new", type=int, default=64, help="max new tokens a generation")
    ap.add_argument("--rounds", type=int, default=3, help="repeats per prompt and mode (medians)")
    ap.add_argument("--gamma", type=int, default=3)
    ap.add_argument("--alone", action="store_true", help="also time target-only decoding per mode (one run each)")
    ap.add_argument("--hostile", action="store_true", help="also time issue 44's hostile schemas through the star")
    ap.add_argument("--out", type=Path, default=result_stem("constrained_speed"), help="results path without suffix")
    a = ap.parse_args(argv)
    from export.target_format import wide_format
    if a.target_format is None:
        a.target_format = wide_format() if a.pair == "qwen" else "native"
    if a.draft_format is None:
        a.draft_format = "Q4_0" if a.pair == "qwen" else "native"
    a.target, a.draft = PAIRS[a.pair]
    return a


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--draft-shim"]:
        draft_shim(argv[1], argv[3:])
        return
    args = args_of(argv)
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        sys.exit("this needs two cores (the target on one, the hub and its draft on another)")
    os.sched_setaffinity(0, {cores[0]})             # this process is the target device
    clock = time_target_grammar()
    from edge.engines.loader import open_model
    from edge.speculative.generate import generate_plain
    from edge.speculative.grammar import JSON_OBJECT, Grammar, grammar_from_json_schema, grammar_tokenizer
    from edge.speculative.sampling import GREEDY
    from edge.star.hub_client import HubClient
    from edge.star.target import StarTarget
    from edge.telemetry.cpu_info import cpu_name
    from edge.wire.link import MqttLink
    from export.target_format import target_gguf
    from server.mosquitto import MosquittoBroker

    target_path = target_gguf(args.target, args.target_format)
    draft_path = target_gguf(args.draft, args.draft_format)
    engine, tok = open_model(str(target_path), backend="llamacpp", threads=1, max_len=2048)
    gtok = grammar_tokenizer(tok, engine.vocab_size)
    prompts = PROMPTS[:args.prompts]
    work = []
    for name, text, schema in prompts:
        ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": text}]))
        grammars = {"unconstrained": None,
                    "json_object": Grammar(grammar_from_json_schema(JSON_OBJECT), gtok),
                    "json_schema": Grammar(grammar_from_json_schema(schema), gtok)}
        grammars["json_schema_no_jump"] = grammars["json_schema_nothing_forced"] = grammars["json_schema"]
        work.append((name, ids, schema, grammars))
    stop_ids = tuple(tok.eos_ids)
    logdir = args.out.parent / (args.out.name + "_logs.tmp")
    logdir.mkdir(parents=True, exist_ok=True)
    stats = logdir / "draft_grammar.json"
    broker = MosquittoBroker().start()
    rows, t0, load_before = [], time.monotonic(), os.getloadavg()
    try:
        with timed_remote_star(str(draft_path), logdir, broker.url, stats):
            link = MqttLink(broker.url, client_id="constrained-bench").connect(10)
            star = StarTarget(engine, HubClient(link, "dev0", tok.fingerprint(), engine.vocab_size), gamma=args.gamma)
            warm = work[0]
            # the target's first ~50 tokens after loading run slow (its weights' pages settling): not timed
            generate_plain(engine, warm[1], 48, GREEDY, stop_ids)
            for mode in MODES[:3]:                 # joins, the draft's grammar tokenizer, warm caches
                star.generate(warm[1], 32, GREEDY, stop_ids=stop_ids, grammar=warm[3][mode])
            for name, ids, schema, grammars in work[1:]:   # the draft compiles each schema outside the timing
                star.generate(ids, 4, GREEDY, stop_ids=stop_ids, grammar=grammars["json_schema"])
            runs = {name: {m: [] for m in MODES} for name, *_ in work}
            # repeats outermost, the mode order rotating per repeat and prompt: a slow spell of the
            # machine lands on every prompt and mode alike instead of on one prompt's runs
            for r in range(args.rounds):
                for p, (name, ids, schema, grammars) in enumerate(work):
                    k = (r + p) % len(MODES)
                    for mode in MODES[k:] + MODES[:k]:
                        runs[name][mode].append(one_run(
                            lambda: star.generate(ids, args.new, GREEDY, stop_ids=stop_ids, grammar=grammars[mode]),
                            tok, clock, stats, mode, schema, lambda: star.last_drafter))
                print(f"repeat {r + 1}/{args.rounds} done", flush=True)
            for name, ids, schema, grammars in work:
                row = {"prompt": name, "prompt_tokens": len(ids),
                       "star": {m: summarise(runs[name][m]) for m in MODES}}
                if args.alone:
                    row["alone"] = {m: summarise([one_run(
                        lambda: generate_plain(engine, ids, args.new, GREEDY, stop_ids, grammar=grammars[m]),
                        tok, clock, None, m, schema)]) for m in MODES}
                u = row["star"]["unconstrained"]["tok_s"]
                row["ratio"] = {m: row["star"][m]["tok_s"] / u for m in MODES[1:]}
                rows.append(row)
                print(f"{name}: " + ", ".join(
                    f"{m} {row['star'][m]['tok_s']:.2f} tok/s acc {row['star'][m]['acceptance']:.2f}"
                    for m in MODES) + f" | ratios {row['ratio']}", flush=True)
            hostile = time_hostile(star, tok, gtok, stop_ids) if args.hostile else None
            star.hub.close()
            link.close()
    finally:
        broker.close()
    meta = {"cpu": cpu_name(), "cores": cores[:2], "pair": args.pair, "target": target_path.name,
            "draft": draft_path.name, "gamma": args.gamma, "new_tokens": args.new, "rounds": args.rounds,
            "prompts": [p[0] for p in prompts], "alone": args.alone, "greedy": True, "hostile": hostile,
            "modes": list(MODES),
            "wall_s": time.monotonic() - t0, "load_avg_before": load_before, "load_avg_after": os.getloadavg(),
            "time": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "command": "python -m benchmarks.star.constrained_speed " + " ".join(argv)}
    write(rows, meta, args.out)
    for f in logdir.iterdir():
        f.unlink()
    logdir.rmdir()


if __name__ == "__main__":
    main()
