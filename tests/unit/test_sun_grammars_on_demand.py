"""A SUN worker's grammar tokenizer loaded at the first grammar (--grammars-on-demand) instead of at
start: nothing is loaded until then, the grammar it compiles allows what the eager one allows, and a
tokenizer that is not the base's refuses that request (a GrammarRefused: the request's 400), not the
worker's start. A --tokenizer that does not resolve still fails the start."""
from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("llguidance")

from edge.model.sun_error import SunError  # noqa: E402
from edge.speculative.grammar import grammar_from_json_schema  # noqa: E402
from edge.sun.token_rules import GrammarRefused  # noqa: E402
from edge.sun.worker_tokenizer import worker_grammars  # noqa: E402
from harness.console_scripts import hf_model  # noqa: E402
from harness.sun_grammars import PERSON  # noqa: E402

VOCAB = 262


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    return hf_model(tmp_path_factory.mktemp("on-demand") / "tiny-hf")


def test_on_demand_loads_nothing_until_the_first_grammar_then_follows_it_as_at_start(tok_dir, tmp_path):
    text = grammar_from_json_schema(PERSON)
    lazy = worker_grammars(tmp_path, str(tok_dir), VOCAB, on_demand=True)
    assert lazy is not None and lazy._llg is None
    eager = worker_grammars(tmp_path, str(tok_dir), VOCAB)
    a, b = lazy.compile(text).matcher(), eager.compile(text).matcher()
    assert lazy._llg is not None
    assert np.array_equal(a.allowed(), b.allowed()) and a.allowed().any()


def test_a_tokenizer_not_the_bases_refuses_the_request_not_the_start(tok_dir, tmp_path):
    lazy = worker_grammars(tmp_path, str(tok_dir), VOCAB - 10, on_demand=True)     # the model's rows: fewer
    with pytest.raises(GrammarRefused, match="more than the model's"):
        lazy.compile(grammar_from_json_schema(PERSON))
    with pytest.raises(SunError, match="more than the model's"):                    # eager: at start
        worker_grammars(tmp_path, str(tok_dir), VOCAB - 10)
    with pytest.raises(SunError, match="--tokenizer"):
        worker_grammars(tmp_path, str(tmp_path / "nothing-here"), VOCAB, on_demand=True)


def test_the_hub_and_the_agent_take_the_option():
    from edge.cli.agent_run import agent_config_from, run
    from server.hub_config import hub_config_from
    from server.hub_serve import serve
    hub = serve.make_context("serve", ["--sun-http-port", "8080", "--sun-tokenizer", "x", "--sun-grammars-on-demand"])
    assert hub_config_from(hub.params).sun.grammars_on_demand
    base = ["--role", "prefill", "--module", "m", "--broker", "mqtt://127.0.0.1:1"]
    agent = run.make_context("run", base + ["--with-decoder", "--grammars-on-demand"])
    sun = agent_config_from(agent.params).sun
    assert sun.with_decoder and sun.grammars_on_demand
    import click
    with pytest.raises(click.UsageError, match="--with-decoder"):
        agent_config_from(run.make_context("run", base + ["--grammars-on-demand"]).params)
