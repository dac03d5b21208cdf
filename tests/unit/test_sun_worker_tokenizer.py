"""Where a SUN worker's grammar tokenizer comes from (edge/sun/worker_tokenizer.py), and what its
hello says: --tokenizer names it, a bundle carrying one needs none, a tuned directory without
either follows no grammars (hello grammars false), a tokenizer wider than the model is refused;
--tokenizer is for the SUN roles only."""
from __future__ import annotations

import pytest
from click.testing import CliRunner

pytest.importorskip("llguidance")

from edge.cli.agent_run import open_node, run  # noqa: E402
from edge.model.sun_error import SunError  # noqa: E402
from edge.model.tokenizer import Tokenizer  # noqa: E402
from edge.speculative.grammar import grammar_from_json_schema  # noqa: E402
from edge.sun.worker_tokenizer import worker_grammars  # noqa: E402
from edge.wire.memory_link import MemoryBus, MemoryLink  # noqa: E402
from harness.console_scripts import sun_dirs  # noqa: E402
from harness.tiny_hf import VOCAB, tokenizer_dir  # noqa: E402


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("sun-tok")
    dec, maths = sun_dirs(root)
    tokenizer_dir(root / "tok")
    return dec, maths, root / "tok"


def test_the_tokenizer_comes_from_the_option_or_a_bundle(dirs, tmp_path):
    from export.bundle import add_tokenizer
    dec, maths, tok = dirs
    assert worker_grammars(dec, None, VOCAB) is None                       # a tuned directory: none
    g = worker_grammars(dec, str(tok), VOCAB)
    assert g.compile(grammar_from_json_schema({"type": "boolean"})).vocab_size == VOCAB
    add_tokenizer(tmp_path, Tokenizer.from_hf_dir(tok))                    # a bundle that carries one
    assert worker_grammars(tmp_path, None, VOCAB) is not None
    with pytest.raises(SunError, match="more than the model"):
        worker_grammars(dec, str(tok), 100)
    with pytest.raises(SunError, match="--tokenizer"):
        worker_grammars(dec, str(tmp_path / "nothing-here"), VOCAB)


def test_a_workers_hello_says_whether_it_follows_grammars(dirs):
    dec, maths, tok = dirs
    bus = MemoryBus()
    for role, module, given in (("decoder", dec, str(tok)), ("prefill", maths, None)):
        node = open_node(role, MemoryLink(bus), str(module), f"w-{role}", tokenizer=given)
        try:
            assert node.status().grammars is (given is not None)
        finally:
            node.stop()


def test_tokenizer_is_for_the_sun_roles():
    out = CliRunner().invoke(run, ["--role", "target", "-m", "x", "--broker", "mqtt://127.0.0.1:1", "--tokenizer", "y"])
    assert out.exit_code != 0 and "--tokenizer is for --role prefill or decoder" in out.output
