"""What the real-model acceptance tests (tests/system/test_real_*.py) ask an OpenAI endpoint, as
agents ask it: a weather tool call, a JSON answer held to a schema; and the module-level skip when
the real models are not fetched (`make test-models`)."""
from __future__ import annotations

from pathlib import Path
from typing import List, Optional

import pytest

from edge.model.fetch import model_path

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "required": ["city"],
                   "properties": {"city": {"type": "string"},
                                  "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}}}}
ASK = [{"role": "user", "content": "What is the weather in Paris? Use the tool."}]


def fetched_or_skip(*names: str) -> List[Path]:
    """The models' files; the calling test module is skipped when one is not fetched."""
    paths = [model_path(n) for n in names]
    missing = [p.name for p in paths if not p.exists()]
    if missing:
        pytest.skip(f"{', '.join(missing)} not fetched (make test-models): this suite runs the real models",
                    allow_module_level=True)
    return paths


def tool_ask(model: str) -> dict:
    """The weather question with the weather tool, greedy, 60 tokens at most."""
    return dict(model=model, messages=ASK, tools=[WEATHER], temperature=0, max_tokens=60)


def city_schema(max_length: Optional[int] = None) -> dict:
    """A city, its country and population; max_length: a bound on the strings (a small model's
    free text within a schema may run on)."""
    text = {"type": "string", **({"maxLength": max_length} if max_length else {})}
    return {"type": "object", "additionalProperties": False, "required": ["city", "country", "population_millions"],
            "properties": {"city": text, "country": text, "population_millions": {"type": "number"}}}


def json_ask(model: str, schema: dict) -> dict:
    """France's capital as JSON held to `schema` (response_format json_schema, strict), greedy."""
    return dict(model=model, temperature=0, max_tokens=60,
                messages=[{"role": "user", "content": "Give the capital of France as JSON with its country and "
                                                      "population in millions."}],
                response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": schema,
                                                                        "strict": True}})


def qwen_llamacpp(max_len: int, n_seq_max: int = 3):
    """(engine, tokenizer) of the real Qwen2.5-Coder-0.5B on llama.cpp, one thread; the calling
    test is skipped when llama-cpp-python or the model is missing (`make test-models`)."""
    pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed: `make llama`")
    fetched_or_skip("qwen2.5-coder-0.5b")
    from edge.engines.loader import open_model
    return open_model("qwen2.5-coder-0.5b", backend="llamacpp", max_len=max_len, threads=1, n_seq_max=n_seq_max)
