"""Our OpenAI endpoint decoding alone, in its own process (benchmarks/serving/agent_workload.py's
"ours" without a star).

    python -m benchmarks.lib.agent_alone_worker --model GGUF --port P [--threads N] [--max-len 4096]
        [--prompt-cache 4] [--prompt-cache-mb 1024] [--prompt-cache-ram 512] [--parallel 2] [--queue 16] [--repack auto|on|off|both]

What `edge-agent run --role target` serves, less the star: the same OpenAIServer in front of
target-only decoding (generate_plain, llama.cpp) with the same prompt cache (`--prompt-cache` /
`--prompt-cache-mb` / `--prompt-cache-ram`, its defaults) and the same `--parallel N` generations at once (their forwards
one batched call a round, edge/engines/batched_calls.py; n_seq_max as the CLI's plan gives it,
edge/memory/fit.engine_sequences). A target started
with no hub answering waits its 3 s join timeout once (at start, edge/star/target.py) and still runs
the star's machinery, so the star-less endpoint is built here instead. The parent pins this
process to a core (taskset) and waits for the "serving on" line on stderr.
"""
from __future__ import annotations

import argparse
import functools
import signal
import sys
import threading

from edge.api.admission import DEFAULT_PARALLEL, DEFAULT_QUEUE


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True, help="a .gguf path or model name")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--threads", type=int, default=None, help="default: the engine's (one per physical core)")
    ap.add_argument("--max-len", type=int, default=4096)
    ap.add_argument("--prompt-cache", type=int, default=4)
    ap.add_argument("--prompt-cache-mb", type=float, default=1024.0)
    ap.add_argument("--prompt-cache-ram", type=float, default=None, help="MB saved to host memory (default: the CLI's)")
    ap.add_argument("--parallel", type=int, default=DEFAULT_PARALLEL, help="generations at once")
    ap.add_argument("--queue", type=int, default=DEFAULT_QUEUE, help="requests waiting beyond them")
    ap.add_argument("--repack", choices=("auto", "on", "off", "both"), default="auto",
                    help="llama.cpp's CPU weight repacking, as edge-agent run --repack")
    return ap


def main(argv=None) -> None:
    server = endpoint(parser().parse_args(argv)).start()
    print(f"serving on http://127.0.0.1:{server.port}/v1", file=sys.stderr, flush=True)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    stop.wait()
    server.stop()


def endpoint(args):
    """The OpenAIServer (not started) over generate_plain on the llama.cpp engine, as main's options say
    (benchmarks/serving/decode_overhead.py profiles the same one)."""
    from edge.api.openai_http import OpenAIServer
    from edge.cli.options import open_prompt_cache
    from edge.engines.batched_calls import shared_engine
    from edge.engines.llamacpp_repack import repack_kwargs
    from edge.engines.loader import open_model
    from edge.memory.fit import engine_sequences
    from edge.speculative.generate import generate_plain

    engine, tok = open_model(args.model, backend="llamacpp", threads=args.threads, max_len=args.max_len,
                             n_seq_max=engine_sequences("llamacpp", args.parallel, args.prompt_cache),
                             **repack_kwargs(getattr(args, "repack", "auto")))
    print(f"loaded {args.model}: {engine.where()}", file=sys.stderr, flush=True)
    engine = shared_engine(engine, args.parallel)
    cache = open_prompt_cache(engine, args.prompt_cache, args.prompt_cache_mb, args.prompt_cache_ram)
    return OpenAIServer(functools.partial(generate_plain, engine, cache=cache), tok, model_name=args.model,
                        port=args.port, context=engine.max_len, parallel=args.parallel, queue=args.queue)


if __name__ == "__main__":
    main()
