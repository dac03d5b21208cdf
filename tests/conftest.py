"""Shared fixtures. Append new fixtures at the end; do not rewrite this file.

Brokers: `mosquitto` (a real Mosquitto on a free loopback port, no ACL),
`mosquitto_acl` (the same with the hub's password file + ACL), `embedded_broker`
(amqtt in-process), `memory_bus`. A missing Mosquitto FAILS the tests that need
it, with the install hint: CI installs it, so a skip would hide a broken setup.
`inbox()` makes a thread-safe message collector for link callbacks.
"""
from __future__ import annotations

import threading
import time

import pytest

# Tiny models, table engines, goodness-of-fit tools, live stars: the top-level `harness` package
# (shared with benchmarks/), importable from the repository root ([tool.pytest.ini_options] pythonpath).


class Inbox:
    """Collects (topic, payload) from link callbacks; wait_for(n) blocks until n arrived."""

    def __init__(self) -> None:
        self.items: list[tuple[str, bytes]] = []
        self._cv = threading.Condition()

    def __call__(self, topic: str, payload: bytes) -> None:
        with self._cv:
            self.items.append((topic, payload))
            self._cv.notify_all()

    def wait_for(self, n: int = 1, timeout: float = 5.0) -> bool:
        end = time.monotonic() + timeout
        with self._cv:
            while len(self.items) < n:
                left = end - time.monotonic()
                if left <= 0:
                    return False
                self._cv.wait(left)
            return True

    def payloads(self) -> list[bytes]:
        with self._cv:
            return [p for _, p in self.items]


@pytest.fixture
def inbox():
    return Inbox


def _mosquitto(acl: bool):
    from server.broker import MosquittoBroker
    # BrokerError ("mosquitto is not installed: apt-get install mosquitto") propagates: fail, not skip
    return MosquittoBroker(acl=acl).start()


@pytest.fixture(scope="session")
def mosquitto():
    broker = _mosquitto(acl=False)
    yield broker
    broker.close()


@pytest.fixture(scope="session")
def mosquitto_acl():
    broker = _mosquitto(acl=True)
    yield broker
    broker.close()


@pytest.fixture(scope="session")
def embedded_broker():
    from server.broker import EmbeddedBroker
    broker = EmbeddedBroker().start()
    yield broker
    broker.stop()


@pytest.fixture
def memory_bus():
    from edge.wire.memory_link import MemoryBus
    return MemoryBus()


# --- exported artifacts (ONNX / GGUF) shared by the engine tests, built once per session ---------

class ExportCache:
    """Tiny llama / qwen2 models and their ONNX / GGUF exports, made on first use.

    Tracing a graph costs seconds, so each artifact is exported once per session
    (export/onnx.py also reuses one trace per model structure).
    """

    VOCAB = 320  # a 300-token test BPE fits, padded like llama.cpp's converter

    def __init__(self, root):
        self.root = root
        self._models, self._files, self._tok = {}, {}, None

    def model(self, arch: str, seed: int = 0):
        import torch
        from edge.model.transformer import Transformer, tiny_config
        key = (arch, seed)
        if key not in self._models:
            torch.manual_seed(seed)
            m = Transformer(tiny_config(arch, vocab_size=self.VOCAB)).eval()
            for p in m.parameters():
                p.data.normal_(0, 0.2)
            self._models[key] = m
        return self._models[key]

    def fingerprint(self, arch: str, seed: int = 0) -> str:
        return f"tiny-{arch}-{seed}"

    def onnx(self, arch: str, kind: str = "model", seed: int = 0, **kw):
        """Path of an exported graph (kw: int4, int4_lm_head, external_data, ...)."""
        from export.onnx import export_onnx
        key = ("onnx", arch, kind, seed, tuple(sorted(kw.items())))
        if key not in self._files:
            name = "-".join([arch, kind, str(seed)] + [f"{k}{v}" for k, v in sorted(kw.items())])
            self._files[key] = export_onnx(self.model(arch, seed), self.root / f"{name}.onnx", kind=kind,
                                           fingerprint=self.fingerprint(arch, seed), **kw)
        return self._files[key]

    def tokenizer(self):
        """harness.tiny_models.small_bpe, trained once per session."""
        if self._tok is None:
            from harness.tiny_models import small_bpe
            self._tok = small_bpe()
        return self._tok

    def gguf(self, arch: str, ftype: str = "F32", seed: int = 0):
        from export.gguf import write_gguf
        key = ("gguf", arch, ftype, seed)
        if key not in self._files:
            m = self.model(arch, seed)
            self._files[key] = write_gguf(self.root / f"{arch}-{seed}-{ftype}.gguf", m.cfg, m.state_dict(),
                                          self.tokenizer(), ftype=ftype)
        return self._files[key]


@pytest.fixture(scope="session")
def exports(tmp_path_factory):
    return ExportCache(tmp_path_factory.mktemp("exports"))


def sun_test_table():
    """export.sun_eval.SYNTHETIC_TABLE at a test's budget: 2/3 of its steps (the base 600 of 800),
    scored on 100 held-out prompts a task, not 200 (tests/system/test_sun_tuning.py: the margins)."""
    from dataclasses import replace
    from export.sun_eval import SYNTHETIC_TABLE as full
    return replace(full, full=replace(full.full, steps=200), sun=replace(full.sun, steps=400),
                   qsun=replace(full.qsun, steps=50))


SUN_TEST_BASE_STEPS, SUN_TEST_EVAL = 600, 100


@pytest.fixture(scope="session")
def sun_table(tmp_path_factory):
    """The synthetic SUN accuracy table (`sun_test_table()`), trained once per session:
    (results, its directory with the specialists, the base)."""
    import torch
    from export.sun_eval import accuracy_table, markdown_table, synthetic_suite
    from harness.synthetic_base import synthetic_base     # trained once, kept (test_sun_demo's too)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)            # faster than 2 for a model this small
    try:
        base = synthetic_base(steps=SUN_TEST_BASE_STEPS, seed=0)
        tasks = synthetic_suite(n_train=20000, n_eval=SUN_TEST_EVAL, seed=0)
        out = tmp_path_factory.mktemp("sun_table")
        res = accuracy_table(base, tasks, sun_test_table(), out_dir=out, progress=False)
    finally:
        torch.set_num_threads(threads)
    print("\n" + markdown_table(res) + "\n" + markdown_table(res, metric="ce"))
    return res, out, base


# ---- `make test` must not pass by skipping --------------------------------------------
# Tests skip (with a reason) when a model or an optional package is absent, so a
# developer can run a subset anywhere. Under `make test` (STARSUN_STRICT=1) and in CI
# every prerequisite is installed by the Makefile, so a skip means a missing install:
# report it as a failure instead of hiding it. Only GPU-only tests may skip there.
import os as _os  # noqa: E402

_STRICT = _os.environ.get("STARSUN_STRICT") == "1" or _os.environ.get("CI") == "true"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    rep = outcome.get_result()
    if _STRICT and rep.skipped and not hasattr(rep, "wasxfail"):
        reason = str(rep.longrepr[-1]) if isinstance(rep.longrepr, tuple) else str(rep.longrepr)
        if not any(w in reason for w in ("GPU", "CUDA", "cuda")):
            rep.outcome = "failed"
            rep.longrepr = f"skipped under `make test`, where everything must be installed: {reason}"


# --- markers: `pytest -m "not slow"` is the quick inner loop; `make test` runs everything ------
# broker: needs a real MQTT broker (Mosquitto or the embedded one); llamacpp: llama-cpp-python;
# real_model: the fetched GGUF models (make test-models); slow: tens of seconds or more.
_BROKER = {"test_draft_service", "test_seed_streams", "test_seed_streams_sun", "test_broker_acl",
           "test_broker_lifecycle", "test_cli_backends", "test_cli_wiring", "test_hub_faults", "test_hub_tls",
           "test_link", "test_hostile_clients", "test_openai_http", "test_starsd_mqtt", "test_sun_http", "test_sun_mqtt",
           "test_star_demo", "test_sun_demo", "test_telemetry_star", "test_star_namespaces", "test_process_faults",
           "test_process_faults_sun", "test_suffix_seed_streams", "test_suffix_star", "test_flash_jetson"}
_LLAMACPP = {"test_bundle", "test_engines_matrix", "test_gguf_export", "test_gguf_smoke", "test_llamacpp_kv",
             "test_model_reference", "test_torch_free_roles", "test_cli_backends", "test_cli_generate",
             "test_memory_plan_cli", "test_memory_plan", "test_tokenizer", "test_flash_jetson"}
_REAL_MODEL = {"test_gguf_export", "test_gguf_smoke", "test_model_reference", "test_onnx_export",
               "test_torch_free_roles", "test_cli_generate", "test_memory_plan_cli", "test_checkpoint",
               "test_tokenizer", "test_flash_jetson"}
_SLOW = _REAL_MODEL | {"test_sun_tuning", "test_cli_wiring", "test_cli_backends", "test_hub_tls",
                       "test_seed_streams", "test_seed_streams_sun", "test_star_demo", "test_sun_demo",
                       "test_hub_faults", "test_engines_matrix", "test_bundle", "test_sun_mqtt", "test_telemetry_star",
                       "test_star_namespaces", "test_suffix_seed_streams", "test_suffix_star", "test_flash_jetson",
                       "test_process_faults", "test_process_faults_sun"}


def pytest_configure(config):
    for name, what in (("broker", "needs a real MQTT broker"), ("llamacpp", "needs llama-cpp-python"),
                       ("real_model", "needs the fetched real models (make test-models)"),
                       ("slow", "takes tens of seconds or more; make test runs it"),
                       ("networks", "brings up a network of its own (RabbitMQ, namespaces, sshd): make test runs "
                                    "these one at a time, beside the rest")):
        config.addinivalue_line("markers", f"{name}: {what}")


# The two xdist workers take the files in collection order (run_tests.sh: --no-loadscope-reorder;
# xdist would otherwise start the files with the most tests first, and a one-test file of two
# minutes could start last): the slowest files start first, longest first, so the files left at
# the end are short and the two workers finish close together. The order follows the slowest tests
# that fresh clones' `make test` printed on 2 cores (--durations; the seed streams ~190 s a file),
# less what was cut since (the ONNX file ~60 s once its optimised graphs are kept, the hostile
# clients ~10 s once their flood's wait no longer runs out).
_START_FIRST = ("test_seed_streams", "test_sun_tuning", "test_sun_demo", "test_onnx_export",
                "test_constrained_lossless", "test_lossless", "test_gpu_check", "test_load",
                "test_constrained_star", "test_llamacpp_prefix_cache", "test_real_agent_star",
                "test_suffix_seed_streams", "test_real_reverse_star", "test_process_faults", "test_gguf_smoke",
                "test_gguf_export", "test_hub_tls", "test_prompt_cache_cli", "test_cli_wiring", "test_model_reference",
                "test_jump_forward", "test_gguf_lora_smollm2", "test_reverse_star", "test_resolved_model",
                "test_tool_formats_http", "test_cli_generate", "test_cli_backends", "test_mosquitto_bridge_star",
                "test_adapter_memory", "test_seed_streams_sun", "test_hostile_clients")


def _slowest_files_first(items) -> None:
    rank = {name: i for i, name in enumerate(_START_FIRST)}
    items.sort(key=lambda item: rank.get(item.module.__name__.rsplit(".", 1)[-1], len(rank)))  # stable


# `make test` runs the suite on two pytest-xdist workers, a file per worker at a time (--dist loadfile),
# but for the tests that bring up a whole network of their own -- RabbitMQ clusters, network
# namespaces, an sshd device: marked `networks`, they run in one more process beside the workers,
# one at a time, so they never contend with each other (scripts/run_tests.sh). They wait on
# events, not on start-up time, so the workers' load slows them down but does not fail them.
_ONE_AT_A_TIME = {"test_cluster_netns_partition", "test_cluster_partition", "test_cluster_sun", "test_flash_jetson",
                  "test_hub_external_tls", "test_multi_hub", "test_netns_helper", "test_rabbit_port_retry",
                  "test_rabbitmq_star", "test_star_namespaces"}


def pytest_collection_modifyitems(config, items):
    _slowest_files_first(items)
    for item in items:
        mod = item.module.__name__.rsplit(".", 1)[-1]
        if mod in _ONE_AT_A_TIME:
            item.add_marker("networks")
        for name, mods in (("broker", _BROKER), ("llamacpp", _LLAMACPP), ("real_model", _REAL_MODEL),
                           ("slow", _SLOW)):
            if mod in mods:
                item.add_marker(name)
        if {"mosquitto", "mosquitto_acl", "embedded_broker"} & set(getattr(item, "fixturenames", ())):
            item.add_marker("broker")


# --- the kit reads nothing outside its own tree (tests/unit/test_self_contained.py) ---------------
# An audit hook records every `open` of a path inside the checkout's sibling `shared` folder (where
# the design notes lived before docs/ had them); the session then fails if anything was recorded.
# This process only: the roles a test starts as subprocesses are covered by the git grep test.
import sys as _sys  # noqa: E402
from pathlib import Path as _Path  # noqa: E402


class SharedOpens:
    """An audit hook: the paths opened inside `root` (resolved, so a symlink into it counts too)."""

    def __init__(self, root) -> None:
        self.root = _os.path.realpath(root)
        self.opened: list[str] = []

    def __call__(self, event: str, args: tuple) -> None:
        if event != "open" or not args or isinstance(args[0], int):
            return
        try:
            path = _os.path.realpath(_os.fsdecode(args[0]))
        except Exception:  # noqa: BLE001 -- an audit hook must never break the open it watches
            return
        if path == self.root or path.startswith(self.root + _os.sep):
            self.opened.append(path)


_SHARED_OPENS = SharedOpens(_Path(__file__).resolve().parents[1].parent / "shared")
_sys.addaudithook(_SHARED_OPENS)


@pytest.fixture
def shared_opens():
    """The session's recorder (its class makes a fresh one for a test of the hook itself)."""
    return _SHARED_OPENS


def pytest_sessionfinish(session, exitstatus):
    if _SHARED_OPENS.opened:
        tr = session.config.pluginmanager.get_plugin("terminalreporter")
        lines = [f"the kit opened files outside its tree (under {_SHARED_OPENS.root}):",
                 *sorted(set(_SHARED_OPENS.opened))[:20]]
        if tr is not None:
            tr.ensure_newline()
            for line in lines:
                tr.write_line(line, red=True)
        else:
            print("\n".join(lines), file=_sys.stderr)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


# -- a test file's own scratch folder, removed when its tests end ------------------------------------
# Exported GGUF / ONNX files run to GBs a file; kept to the end of the run (pytest's default for
# tmp_path_factory) they filled a CI machine's disk. Function-scoped tmp_path folders of passed tests
# go at once ([tool.pytest.ini_options] tmp_path_retention_policy = "failed").
import shutil as _shutil  # noqa: E402


@pytest.fixture(scope="module")
def module_tmp_path(request, tmp_path_factory):
    d = tmp_path_factory.mktemp(request.module.__name__.rsplit(".", 1)[-1])
    yield d
    _shutil.rmtree(d, ignore_errors=True)
