"""`edge-agent generate` without -b picks the engine from the artifact (as the loader resolves it), so
it runs on a device that has llama.cpp or onnxruntime but no torch: a GGUF opens on llama.cpp and
torch never enters the interpreter."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

SCRIPT = r"""
import json, sys
from edge.cli.agent import main
try:
    main(["generate", "a b c", "-T", sys.argv[1], "-D", "ngram", "-n", "4", "--raw", "--no-compare",
          "--max-len", "64"], standalone_mode=False)
    code = 0
except SystemExit as e:
    code = e.code
print("RESULT " + json.dumps({"code": code, "torch": "torch" in sys.modules}))
"""


def test_generate_defaults_to_the_artifacts_backend_and_never_imports_torch(exports):
    pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed: `make llama`")
    r = subprocess.run([sys.executable, "-c", SCRIPT, str(exports.gguf("llama"))], capture_output=True, text=True,
                       cwd=REPO, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    got = json.loads(next(x for x in r.stdout.splitlines() if x.startswith("RESULT "))[len("RESULT "):])
    assert got == {"code": 0, "torch": False}, r.stderr[-2000:]
    assert "placement: llamacpp on cpu" in r.stderr and " on llamacpp (vocab " in r.stderr, r.stderr


def test_generate_help_says_the_default_is_auto():
    from click.testing import CliRunner
    from edge.cli.agent import main
    out = CliRunner().invoke(main, ["generate", "--help"]).output
    backend = out[out.index("-b, --backend"):out.index("  --draft-backend [")]
    assert "[default: auto]" in " ".join(backend.split()), backend


def test_a_target_run_defaults_to_the_artifacts_backend(exports):
    """`edge-agent run --role target -m X.gguf` without -b: the GGUF runs on llama.cpp (the start
    line says so), as on a device that installed only the llama extra."""
    pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed: `make llama`")
    p = subprocess.Popen([str(Path(sys.executable).parent / "edge-agent"), "run", "--role", "target",
                          "-m", str(exports.gguf("llama")), "--broker", "mqtt://127.0.0.1:9", "--client-id", "auto-t",
                          "--http-port", "0", "--max-len", "64"],
                         stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, cwd=REPO)
    lines = []
    try:
        for line in p.stderr:                     # until the model is loaded (the hub is unreachable on purpose)
            lines.append(line)
            if line.startswith("loaded "):
                break
    finally:
        p.kill()
        p.wait(30)
    err = "".join(lines)
    assert "placement: llamacpp on cpu" in err and " on llamacpp (vocab " in err, err


def test_run_help_says_the_default_is_auto():
    from click.testing import CliRunner
    from edge.cli.agent import main
    out = CliRunner().invoke(main, ["run", "--help"]).output
    backend = out[out.index("-b, --backend"):]
    assert "[default: auto]" in " ".join(backend.split()[:80]), backend


def test_the_hubs_draft_defaults_to_auto_like_every_agent_command(exports):
    """`edge-hub serve --draft-model X.gguf` without --draft-backend: auto, as on every edge-agent
    command, so a GGUF draft runs on llama.cpp where it is installed (not dequantised into torch)."""
    pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed: `make llama`")
    from edge.model.resolved import resolve
    from server.hub_config import hub_config_from
    from server.hub_serve import serve
    cfg = hub_config_from(serve.make_context("serve", ["--draft-model", str(exports.gguf("llama"))]).params)
    assert cfg.draft_backend == "auto"
    model = resolve(cfg.draft.model, cfg.draft_backend, "draft")
    assert model.backend == "llamacpp" and model.reason, model
