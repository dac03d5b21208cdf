"""`edge-agent generate --exact-rows` as a user runs it on the real Qwen2.5-Coder-0.5B Q4_K_M, two
threads, a prompt past 256 tokens (where a lone decode step's attention is split between the
threads): the speculative greedy text (n-gram drafts, verifies of several rows) is the target's
plain greedy text token for token, and the start line says the calls are padded."""
import re

from click.testing import CliRunner

from edge.cli.agent import main as agent
from harness.agent_asks import fetched_or_skip

CODE = "\n".join(f"def f{i}(x):\n    return x * {i} + {i % 7}\n" for i in range(40))


def test_generate_with_exact_rows_agrees_token_for_token():
    path, = fetched_or_skip("qwen2.5-coder-0.5b")
    r = CliRunner().invoke(agent, ["generate", CODE + "\nWrite f40 to f45 in the same style.", "-T", str(path),
                                   "-D", "ngram", "-n", "48", "--gamma", "4", "--threads", "2", "--max-len", "1024",
                                   "--exact-rows"])
    assert r.exit_code == 0, r.output
    assert "--exact-rows (" in r.output                   # the placement line
    agree = re.search(r"greedy outputs agree on the first (\d+) of (\d+) tokens", r.output)
    assert agree and agree.group(1) == agree.group(2) and int(agree.group(2)) >= 16, r.output
    assert re.search(r"speculative\s+\d+\s+[\d.]+\s+[\d.]+\s+[\d.]+", r.output), r.output   # verifies happened


def test_a_real_star_with_exact_rows_answers_the_targets_own_greedy_text(tmp_path, mosquitto):
    """A draft service and a target as a user starts them (the real 0.5B both, the target with
    `--exact-rows` at two threads over a prompt past 256 tokens): the star's greedy answer is the
    text `generate` decodes with the target alone, token for token."""
    from server.hub import Hub
    from harness.console_scripts import BIN, Procs
    path, = fetched_or_skip("qwen2.5-coder-0.5b")
    prompt = CODE + "\nWrite f40 to f45 in the same style."
    alone = CliRunner().invoke(agent, ["generate", prompt, "-T", str(path), "-D", "ngram", "-n", "32",
                                       "--threads", "2", "--max-len", "1024", "--exact-rows"])
    assert alone.exit_code == 0, alone.output
    hub = Hub(broker_url=mosquitto.url).start()
    ps = Procs(tmp_path)
    common = [BIN / "edge-agent", "run", "--broker", mosquitto.url, "--max-len", "1024", "-m", path]
    try:
        ps.start("draft", *common, "--threads", "1", "--role", "draft", "--client-id", "draft-x", "--no-ahead")
        ps.wait_for("draft", "registered at", timeout=120)
        ps.start("target", *common, "--threads", "2", "--exact-rows", "--role", "target", "--client-id", "target-x",
                 "--prompt", prompt, "-n", "32", "-g", "3", "--temperature", "0")
        assert ps.procs["target"].wait(300) == 0, ps.err("target") + ps.err("draft")
        err = ps.err("target")
        assert "--exact-rows (" in err and "joined the star" in err, err
        assert int(err.split("answered ")[1].split("/")[0]) > 0, err + ps.err("draft")   # drafts were accepted
        answer = ps.out("target").strip()
        assert answer and answer in alone.stdout, (answer, alone.stdout)
    finally:
        ps.close()
        hub.stop()
