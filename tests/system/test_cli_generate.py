"""`edge-agent generate`: bad input gives a clear error, not a traceback; a real run reports its stats."""
import pytest
from click.testing import CliRunner

from edge.cli.agent import main
from edge.model.fetch import model_path

SMOL, QWEN = model_path("smollm2-135m"), model_path("qwen2.5-coder-0.5b")
needs_models = pytest.mark.skipif(not (SMOL.exists() and QWEN.exists()),
                                  reason="real models absent: run `make test-models`")


def run(*args):
    return CliRunner().invoke(main, ["generate", *args])


def test_gamma_below_one_is_refused():
    r = run("hi", "-g", "0")
    assert r.exit_code == 2
    assert "--gamma" in r.output and "an integer >= 1" in r.output and "Traceback" not in r.output


def test_the_old_adaptive_flag_names_the_new_spelling():
    r = run("hi", "-g", "4", "--adaptive")
    assert r.exit_code == 2 and "--gamma auto:4" in r.output


def test_missing_and_corrupt_checkpoints(tmp_path):
    r = run("hi", "-T", str(tmp_path / "nope.gguf"))
    assert r.exit_code == 1 and "no such model file" in r.output
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\0" * 64)
    r = run("hi", "-T", str(bad), "-D", "ngram")
    assert r.exit_code == 1 and "Error:" in r.output and "Traceback" not in r.output


@needs_models
def test_draft_with_another_tokenizer_is_refused():
    r = run("hi", "-T", "smollm2-135m", "-D", "qwen2.5-coder-0.5b", "-b", "llamacpp")
    assert r.exit_code == 1 and "different tokenizers" in r.output


@needs_models
def test_prompt_longer_than_the_context_is_refused():
    r = run("word " * 300, "-T", "smollm2-135m", "-D", "ngram", "-b", "llamacpp", "--max-len", "128")
    assert r.exit_code == 1 and "exceeds the context" in r.output


@needs_models
@pytest.mark.parametrize("gamma", ["3", "auto:3"])
def test_ngram_run_reports_stats_and_matches_target_alone(gamma):
    r = run("Say the alphabet: a b c d e f", "-T", "smollm2-135m", "-D", "ngram", "-b", "llamacpp",
            "-n", "12", "-g", gamma)
    assert r.exit_code == 0, r.output
    for label in ("speculative", "target alone", "speedup vs target alone", "tok/verify", f"γ={gamma}"):
        assert label in r.output
