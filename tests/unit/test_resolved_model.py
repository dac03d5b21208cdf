"""Resolve once (issue 43): a model is resolved where a command first sees it, into one
ResolvedModel (edge/model/resolved.py), and `auto` means one thing everywhere (auto_backend).

One test per disagreement there was: plan and run on the same file with and without
llama-cpp-python, provisioning's check of a GGUF-only SUN bundle, the hub's --sun-backend auto,
a bundle's model id, generate's default draft; and the count of resolutions and manifest reads
of one command."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from edge.model.resolved import BACKENDS, auto_backend, resolve

ALL = frozenset(BACKENDS)
NO_LLAMA = ALL - {"llamacpp"}


def quiet(*_):
    pass


@pytest.fixture(scope="module")
def target_bundle(exports, tmp_path_factory):
    """A bundle of one F32 GGUF of the tiny llama (every role), with its tokenizer, at an absolute path."""
    from export.bundle import build_bundle
    d = tmp_path_factory.mktemp("resolved") / "tiny-bundle"
    build_bundle(exports.gguf("llama", "F32"), d, onnx_graphs=[], gguf_types=["F32"], log=quiet)
    return d.resolve()


@pytest.fixture(scope="module")
def qsun_bundle(tmp_path_factory):
    """A GGUF-only bundle of a SUN shared decoder (what `edge-export bundle DEC OUT --gguf` makes of QSUN's)."""
    from export.bundle import build_bundle
    from harness.console_scripts import hf_model, sun_dirs
    root = tmp_path_factory.mktemp("qsun")
    dec_dir, _ = sun_dirs(root)
    out = root / "qsun-bundle"
    build_bundle(dec_dir, out, onnx_graphs=(), gguf_types=("F32",), tokenizer=hf_model(root / "tiny-hf"), log=quiet)
    return out


def test_the_one_auto_rule():
    assert auto_backend("gguf", ALL)[0] == "llamacpp"
    assert auto_backend("gguf", NO_LLAMA) == ("torch", "a .gguf without llama-cpp-python installed: torch "
                                                       "dequantises it")
    assert auto_backend("onnx", frozenset())[0] == "onnx"
    assert auto_backend("hf", ALL)[0] == auto_backend("sun", ALL)[0] == "torch"
    assert auto_backend("bundle", ALL, ["onnx", "llamacpp"])[0] == "onnx"        # the first for the role
    assert auto_backend("bundle", NO_LLAMA - {"onnx"}, ["onnx", "llamacpp"])[0] == "onnx"   # none installed
    assert auto_backend("bundle", {"llamacpp"}, ["onnx", "llamacpp"])[0] == "llamacpp"     # the installed one


def _plan_backend(args) -> str:
    from edge.cli.agent import main
    r = CliRunner().invoke(main, ["plan", "--json", *args])
    assert r.exit_code == 0, r.output
    return json.loads(r.output)["backend"]


def _run_until_load(monkeypatch, args) -> tuple:
    """`edge-agent run` up to the engine load: (the ResolvedModel it would open, its output)."""
    import edge.cli.agent_run as agent_run
    from edge.cli.agent import main
    seen = {}

    def fake_open(model, *a, **kw):
        seen["model"] = model
        raise SystemExit(0)
    monkeypatch.setattr(agent_run, "open_model_for_command", fake_open)
    r = CliRunner().invoke(main, ["run", "--broker", "mqtt://127.0.0.1:1", "--max-len", "64", *args])
    assert r.exit_code == 0, r.output
    return seen["model"], r.output


@pytest.mark.parametrize("installed,want", [(ALL, "llamacpp"), (NO_LLAMA, "torch")])
def test_plan_and_run_choose_the_same_backend_for_a_gguf(monkeypatch, exports, installed, want):
    """Without llama-cpp-python `plan -b auto` sized a .gguf for llama.cpp while `run` loaded it on torch."""
    monkeypatch.setattr("edge.model.resolved.installed_backends", lambda: installed)
    gguf = str(exports.gguf("llama"))
    planned = _plan_backend(["--role", "target", "-m", gguf])
    model, out = _run_until_load(monkeypatch, ["--role", "target", "-m", gguf])
    assert planned == model.backend == want
    assert f"placement: {want} on cpu" in out and f"; backend: {model.reason}" in out, out


def test_artifact_check_runs_a_gguf_only_sun_bundle_on_llamacpp(qsun_bundle):
    """It called every SUN bundle "onnx", so `make flash-jetson ROLE=decoder` refused a QSUN GGUF bundle."""
    from devices.artifact_check import check_artifact
    a = check_artifact("decoder", "cpu-2core", module=str(qsun_bundle), memory_budget="4G")
    assert a.backend == "llamacpp" and "decoder on llamacpp" in a.summary
    # and the agent on the device, with llama.cpp installed, resolves it the same way
    assert resolve(str(qsun_bundle), "auto", "decoder").backend == a.backend


def test_the_hub_resolves_sun_backend_before_the_decoder_sizes_its_sequences(monkeypatch, qsun_bundle):
    """`edge-hub serve --sun-backend auto`: SharedDecoder.from_dir got the literal "auto" and sized a
    llama.cpp context's sequences only for "llamacpp"."""
    import edge.sun.prefill as prefill
    from server.hub_config import hub_config_from
    from server.hub_serve import _sun_decoder, serve

    class Sized(Exception):
        pass
    got = {}

    def engine(directory, backend, role, threads, **kw):
        got.update(kw, backend=backend, role=role, model=directory)
        raise Sized
    monkeypatch.setattr(prefill, "_bundle_engine", engine)
    cfg = hub_config_from(serve.make_context("serve", ["--sun-decoder", str(qsun_bundle), "--sun-backend", "auto",
                                                       "--sun-max-batch", "8"]).params)
    assert cfg.sun.backend == "auto"
    with pytest.raises(Sized):
        _sun_decoder(cfg)
    assert (got["backend"], got["role"], got["n_seq_max"]) == ("llamacpp", "decoder", 8)
    assert got["model"].artifact["sun"] == "sun-decoder"          # the artifact picked once, handed down


def test_a_bundles_model_id_is_its_name_not_its_path(monkeypatch, target_bundle):
    import edge.cli.agent_run as agent_run
    from edge.cli.agent import main
    assert target_bundle.is_absolute()
    m = resolve(str(target_bundle), role="target")
    assert m.name == "tiny-bundle" and "/" not in m.name
    assert resolve(str(target_bundle) + "/", role="target").name == "tiny-bundle"
    served = {}

    def fake_target(engine, tok, link, client_id, model, *a):
        served["model"] = model
        engine.close()
    monkeypatch.setattr(agent_run, "run_target", fake_target)
    r = CliRunner().invoke(main, ["run", "--role", "target", "-m", str(target_bundle), "--broker",
                                  "mqtt://127.0.0.1:1", "--max-len", "64"])
    assert r.exit_code == 0, r.output
    assert served["model"] == "tiny-bundle"                       # what /v1/models and the start line show


def test_a_model_is_resolved_once_per_command(monkeypatch, target_bundle, exports):
    """`edge-agent plan` and `edge-agent run --role target` (to its loaded engine) resolve the name
    once and read a bundle's manifest once; everything below takes the ResolvedModel."""
    import edge.cli.agent_run as agent_run
    import edge.model.reference as reference
    from edge.cli.agent import main
    calls = {"resolve": 0, "manifest": 0}
    real_resolve, real_bytes, real_text = reference.resolve_model, Path.read_bytes, Path.read_text

    def counted_resolve(ref):
        calls["resolve"] += 1
        return real_resolve(ref)

    def counted(real):
        def read(self, *a, **kw):
            calls["manifest"] += self.name == "manifest.json"
            return real(self, *a, **kw)
        return read
    monkeypatch.setattr(reference, "resolve_model", counted_resolve)
    monkeypatch.setattr(Path, "read_bytes", counted(real_bytes))
    monkeypatch.setattr(Path, "read_text", counted(real_text))
    monkeypatch.setattr(agent_run, "run_target", lambda engine, *a: engine.close())

    def count(args) -> dict:
        calls.update(resolve=0, manifest=0)
        r = CliRunner().invoke(main, args)
        assert r.exit_code == 0, r.output
        return dict(calls)
    assert count(["plan", "--role", "target", "--bundle", str(target_bundle), "--memory-budget", "4G"]) == \
        {"resolve": 1, "manifest": 1}
    assert count(["plan", "--role", "draft", "-m", str(exports.gguf("llama"))]) == {"resolve": 1, "manifest": 0}
    run = ["run", "--role", "target", "--broker", "mqtt://127.0.0.1:1", "--max-len", "64", "--memory-budget", "4G"]
    assert count(run + ["-m", str(target_bundle)]) == {"resolve": 1, "manifest": 1}
    assert count(run + ["-m", str(exports.gguf("llama"))]) == {"resolve": 1, "manifest": 0}


def test_the_bundle_manifest_is_handed_down_not_read_again(target_bundle, monkeypatch):
    """The loader, the shape and the tokenizer take a resolved bundle's manifest."""
    import edge.model.bundle_manifest as bm
    from edge.engines.loader import open_model
    m = resolve(str(target_bundle), "llamacpp", "target")
    monkeypatch.setattr(bm, "read_manifest", lambda *_: pytest.fail("the manifest was read again"))
    monkeypatch.setattr("edge.engines.loader.read_manifest", lambda *_: pytest.fail("the manifest was read again"))
    engine, tok = open_model(m, max_len=64, n_seq_max=1)
    assert m.shape.vocab == engine.vocab_size and tok is not None
    engine.close()


@pytest.mark.parametrize("target,want", [("smollm2-135m", "ngram"), ("qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b")])
def test_generates_default_draft_has_the_targets_tokenizer(target, want, capsys):
    """`edge-agent generate -T smollm2-135m` drafted with Qwen 0.5B and failed on the tokenizer."""
    from edge.cli.agent import default_draft
    from edge.engines.loader import open_tokenizer
    from edge.model.fetch import model_path
    if not model_path(target).exists() or not model_path("qwen2.5-coder-0.5b").exists():
        pytest.skip("the real models are not fetched (make models)")
    m = resolve(target, role="target")
    tok = open_tokenizer(m)
    name, dtok = default_draft(m, tok)
    assert name == want
    assert dtok is None if want == "ngram" else dtok.fingerprint() == tok.fingerprint()
    err = capsys.readouterr().err
    assert ("no fetched model smaller than smollm2-135m has its tokenizer" in err) == (want == "ngram"), err


def test_generate_with_a_smollm2_target_and_no_draft_runs(capsys):
    from edge.cli.agent import main
    from edge.model.fetch import model_path
    if not model_path("smollm2-135m").exists():
        pytest.skip("smollm2-135m is not fetched (make models)")
    main(["generate", "Say hi.", "-T", "smollm2-135m", "-n", "4", "--no-compare", "--max-len", "256"],
         standalone_mode=False)
    err = capsys.readouterr().err
    assert "draft: n-gram prompt lookup" in err and "--- speculative: draft n-gram prompt lookup" in err, err
