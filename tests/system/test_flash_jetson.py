"""`make flash-jetson` against a real sshd "device" (harness/ssh_device.py), a real hub on a
real Mosquitto, and the agent started from the unit's own ExecStart line as the device's user
(there is no systemd PID 1 here, so nothing starts the unit itself).
"""
from __future__ import annotations

import hashlib
import json
import queue
import shlex
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from devices.agent_files import exec_start_of
from devices.install_recipe import build_wheel
from devices.provision import main as provision
from edge.engines.loader import BUNDLE_FORMAT, BUNDLE_VERSION, MANIFEST, sha256_file
from edge.model.fetch import model_path
from harness.ssh_device import SshDevice, free_port

SMOL = "smollm2-135m"
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def device():
    d = SshDevice().start()
    yield d
    d.close()


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    """The kit's wheel, built once (provisioning builds the same when --wheel is not given)."""
    return build_wheel(tmp_path_factory.mktemp("wheel"))


@pytest.fixture(scope="module")
def smol():
    p = model_path(SMOL)
    if not p.exists():
        pytest.skip(f"{SMOL} is not fetched (make test-models)")
    return p


@pytest.fixture
def hub(mosquitto):
    from server.hub import Hub
    h = Hub(broker_url=mosquitto.url, hub_id="flashhub", status_every=0.5).start()
    yield h
    h.stop()


def _args(device, wheel, hub_url, *more):
    return ["--ssh", device.alias, "--ssh-config", str(device.ssh_config), "--profile", "cpu-2core",
            "--broker", hub_url, "--deps", "device", "--wheel", str(wheel), "--device-python", device.python,
            "--timeout", "60", *more]


def _tree_hashes(root: Path) -> dict:
    return {str(p.relative_to(root)): (hashlib.sha256(p.read_bytes()).hexdigest(), p.stat().st_mtime_ns)
            for p in sorted(root.rglob("*")) if p.is_file() and "__pycache__" not in p.parts}


class Provision:
    """`python -m devices.provision` as its own process, its output read line by line as it comes."""

    def __init__(self, args):
        self.proc = subprocess.Popen([sys.executable, "-m", "devices.provision", *args], cwd=REPO, text=True,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        self.lines: "queue.Queue" = queue.Queue()
        self.out = ""
        threading.Thread(target=lambda: [self.lines.put(x) for x in self.proc.stdout] + [self.lines.put(None)],
                         daemon=True).start()

    def until(self, text: str, timeout: float = 60.0) -> str:
        """Output up to the line holding `text` (step 9 prints the agent's command once the join watch is on)."""
        end = time.monotonic() + timeout
        while text not in self.out:
            line = self.lines.get(timeout=max(0.1, end - time.monotonic()))
            assert line is not None, f"provisioning ended before {text!r}:\n{self.out}"
            self.out += line
        return self.out

    def finish(self, timeout: float = 90.0) -> str:
        self.proc.wait(timeout)
        while (line := self.lines.get(timeout=10)) is not None:
            self.out += line
        return self.out

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()


START = "start the agent now with: "


def test_provision_lands_files_joins_the_hub_and_a_second_run_changes_nothing(device, wheel, smol, hub, tmp_path):
    secret = tmp_path / "draft.pw"
    secret.write_text("not-on-any-command-line\n")      # this broker lets anyone in: it is only carried
    args = _args(device, wheel, hub.url, "--role", "draft", "--model", str(smol), "--client-id", "flash-draft",
                 "--max-len", "256", "--max-sessions", "2", "--set", "threads=1", "--password-file", str(secret))
    prov = Provision(args)
    unit = device.home / ".config/systemd/user/starsun-agent.service"
    agent = None
    try:
        prov.until(START)        # no systemd here: we start what the unit would
        assert (device.home / ".config/systemd/user/default.target.wants/starsun-agent.service").is_symlink()
        cmd = exec_start_of(unit.read_text())
        log = device.pc / "agent.log"
        with open(log, "wb") as f:
            agent = device.as_user(shlex.split(cmd), cwd=str(device.home / "starsun"), stdout=f,
                                   stderr=subprocess.STDOUT)
        out = prov.finish()
        assert prov.proc.returncode == 0, out + "\nagent:\n" + log.read_text()
        assert "draft service flash-draft registered at the hub" in out
        print(out)
        assert "flash-draft" in hub.status().services
        for n in range(1, 11):
            assert f"[{n}/10]" in out
        assert "systemd is not running on the device" in out and START + cmd in out
        assert 'CPU profile: the model runs on the CPU (accelerator = "cpu")' in out     # the final placement check

        root = device.home / "starsun"
        assert sha256_file(root / "artifacts" / smol.name) == sha256_file(smol)
        assert (root / "wheels" / wheel.name).read_bytes() == wheel.read_bytes()
        cfg = (root / "agent.toml").read_text()
        for line in ('role = "draft"', f'broker = "{hub.url}"', 'client_id = "flash-draft"', 'backend = "llamacpp"',
                     f'model = "{root}/artifacts/{smol.name}"', 'profile = "cpu-2core"', "max_len = 256",
                     "threads = 1", 'username = "flash-draft"', f'password_file = "{root}/credentials/mqtt.password"',
                     'accelerator = "cpu"'):         # the profile's placement (devices/gpu_confirm.py)
            assert line in cfg.splitlines(), cfg
        pw = root / "credentials/mqtt.password"
        assert pw.read_text() == secret.read_text() and oct(pw.stat().st_mode & 0o777) == "0o600"
        assert "not-on-any-command-line" not in cfg
        assert cmd == f"{root}/venv/bin/edge-agent run --config {root}/agent.toml"
        assert (root / "venv/lib").is_dir() and "include-system-site-packages = true" in (root / "venv/pyvenv.cfg").read_text()
        if shutil.which("systemd-analyze"):    # checks its syntax and that ExecStart is executable
            r = subprocess.run(["systemd-analyze", "verify", str(unit)], capture_output=True, text=True)
            assert r.returncode == 0, r.stdout + r.stderr

        before = _tree_hashes(device.home)
        again = CliRunner().invoke(provision, args)
        assert again.exit_code == 0, again.output
        print(again.output)
        assert "nothing changed" in again.output and "registered at the hub" in again.output
        for what in ("unchanged (", "unchanged: "):
            assert what in again.output
        assert _tree_hashes(device.home) == before

        bad = CliRunner().invoke(provision, args + ["--set", "no_such_option=1"])   # the device's agent checks keys
        assert bad.exit_code == 1
        assert "step 7/10 (the agent's config) failed: the agent on the device refuses" in bad.output
        assert "unknown key 'no_such_option'" in bad.output and "run the same command again" in bad.output
    finally:
        prov.kill()
        if agent is not None:
            agent.terminate()
            agent.wait(10)


def test_a_target_is_provisioned_and_joins_a_hub_that_drafts(device, wheel, smol, mosquitto):
    from edge.engines.loader import open_model
    from server.hub import Hub
    engine, tok = open_model(str(smol), backend="llamacpp", max_len=512)
    hub = Hub(broker_url=mosquitto.url, hub_id="flashstar", draft_engine=engine, tokenizer_fp=tok.fingerprint(),
              status_every=0.5).start()
    port = free_port()
    args = _args(device, wheel, hub.url, "--role", "target", "--model", str(smol), "--client-id", "flash-target",
                 "--max-len", "256", "--set", f"http_port={port}", "--set", "threads=1")
    prov = Provision(args)
    unit = device.home / ".config/systemd/user/starsun-agent.service"
    agent = None
    try:      # the watch is on before the target starts: the hub's Joined is not retained
        prov.until(START)
        assert "target flash-target" in unit.read_text()
        agent = device.as_user(shlex.split(exec_start_of(unit.read_text())), cwd=str(device.home / "starsun"),
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        out = prov.finish()
        assert prov.proc.returncode == 0, out
        assert "target flash-target joined the star: session" in out and "drafted by flashstar-draft" in out, out
        # step 10 ends when the endpoint answers on the device, not at the join (issue 43)
        assert f"for the OpenAI endpoint on the device (GET http://127.0.0.1:{port}/v1/models)" in out, out
        assert f"its OpenAI endpoint answers on the device: GET http://127.0.0.1:{port}/v1/models lists " in out, out
        assert 'role = "target"' in (device.home / "starsun/agent.toml").read_text()
    finally:
        prov.kill()
        if agent is not None:
            agent.terminate()
            agent.wait(10)
        hub.stop()


def test_without_rsync_files_go_by_scp(device, tmp_path):
    from devices.remote import Remote
    f = tmp_path / "payload.bin"
    f.write_bytes(b"\x00starsun\xff" * 1000)
    r = Remote(device.alias, str(device.ssh_config))          # rsync stays off: scp (SFTP)
    r.push(f, f"{device.home}/scp-test")
    assert (device.home / "scp-test/payload.bin").read_bytes() == f.read_bytes()
    assert r.sha256([f"{device.home}/scp-test/payload.bin", f"{device.home}/missing"]) == {
        f"{device.home}/scp-test/payload.bin": hashlib.sha256(f.read_bytes()).hexdigest()}


def _bundle(tmp_path: Path, gguf: Path) -> Path:
    """A bundle holding the GGUF (as `edge-export bundle --gguf` lays one out)."""
    b = tmp_path / "smol-bundle"
    b.mkdir()
    try:                                     # the file itself (a bundle refuses links out of it)
        (b / gguf.name).hardlink_to(gguf)
    except OSError:
        shutil.copy(gguf, b / gguf.name)
    art = {"name": "smol.q4_1", "backend": "gguf", "graph": "gguf", "roles": ["draft", "target"], "quant": "Q4_1",
           "fingerprint": "x", "kv_fingerprint": "x",
           "files": [{"path": gguf.name, "bytes": gguf.stat().st_size, "sha256": sha256_file(gguf)}]}
    (b / MANIFEST).write_text(json.dumps({"format": BUNDLE_FORMAT, "version": BUNDLE_VERSION, "tokenizer": None,
                                          "artifacts": [art]}))
    return b


def test_refusals_name_the_step_and_leave_the_device_untouched(device, wheel, smol, tmp_path):
    hub_url = "mqtt://127.0.0.1:1"           # never reached: each run stops before the wait
    before = device.snapshot()
    cases = [
        (["--ssh", f"{device.alias}-down", "--role", "draft", "--model", str(smol)],
         "step 3/10 (the device is ready) failed: cannot reach"),
        (["--role", "draft", "--bundle", str(_bundle(tmp_path, smol)), "--max-len", "131072"],
         "step 2/10 (the artifact fits the profile) failed: draft on llamacpp does not fit profile cpu-2core"),
        (["--role", "target", "--model", str(tmp_path / "missing.gguf")],
         "step 2/10 (the artifact fits the profile) failed: MODEL="),
        (["--role", "draft", "--bundle", str(tmp_path / "no-bundle")], "BUNDLE="),
        (["--role", "target", "--model", str(smol), "--profile", "jetson-orin-nano-8gb"],
         "is a Jetson (aarch64) but the device is x86_64"),
    ]
    for more, expect in cases:
        args = _args(device, wheel, hub_url, *more)
        if more[0] == "--ssh":
            args = args[2:]
        r = CliRunner().invoke(provision, args)
        assert r.exit_code != 0, r.output
        assert expect in r.output, r.output
        assert "nothing on the device was changed" in r.output and "run the same command again" in r.output
    r = CliRunner().invoke(provision, _args(device, wheel, hub_url, "--role", "prefill", "--model", str(smol)))
    assert r.exit_code != 0 and "MODULE=DIR" in r.output, r.output
    assert device.snapshot() == before


def test_dry_run_prints_each_step_and_contacts_nothing(smol):
    r = CliRunner().invoke(provision, ["--ssh", "nvidia@jetson.invalid", "--role", "target", "--broker",
                                       "mqtt://hub.local:1883", "--model", str(smol), "--dry-run"])
    assert r.exit_code == 0, r.output
    for n in range(1, 11):
        assert f"[{n}/10]" in r.output
    out = r.output
    assert "onnxruntime" not in out and "safetensors" not in out      # a llama.cpp target: its backend only
    assert "-DGGML_CUDA=on -DCMAKE_CUDA_ARCHITECTURES=87" in out and "'torch" not in out
    assert "du -sk /home/nvidia/starsun/venv" in out                    # the install size, reported
    assert "loginctl enable-linger nvidia" in out and "--system-site-packages" in out
    assert f'model = "/home/nvidia/starsun/artifacts/{smol.name}"' in out
    assert "GETs http://127.0.0.1:8000/v1/models until it answers" in out     # a target: step 10 waits for it
    assert "dry run: nothing was changed on nvidia@jetson.invalid" in out


def _decoder_module(tmp_path: Path) -> Path:
    """A SUN shared-decoder directory (as `edge-export tune` writes one) of a tiny random model."""
    from edge.model.sun_modules import weights_fingerprint
    from export.tune import save_decoder
    from harness.tiny_models import tiny_model
    m = tiny_model()
    return save_decoder(tmp_path / "decoder", m, "fp32", weights_fingerprint(m))


def test_a_sun_decoder_is_planned_and_its_join_is_seen(tmp_path, hub):
    module = _decoder_module(tmp_path)
    r = CliRunner().invoke(provision, ["--ssh", "nv@jetson.invalid", "--role", "decoder", "--broker", hub.url,
                                       "--module", str(module), "--max-batch", "16", "--dry-run"])
    assert r.exit_code == 0, r.output
    for line in ('role = "decoder"', 'module = "/home/nv/starsun/artifacts/decoder"', 'backend = "torch"',
                 "max_batch = 16"):
        assert line in r.output, r.output
    # what step 10 reads for a SUN worker: its retained hello, here from a real decoder node on the hub's broker
    from devices.join_wait import JoinWatch
    from edge.cli.agent_run import open_node
    from edge.wire.link import MqttLink
    watch = JoinWatch(hub.url, "decoder", "flash-dec").start()
    link = MqttLink(hub.url, client_id="flash-dec")
    node = open_node("decoder", link, str(module), "flash-dec", max_batch=16)
    try:
        assert watch.wait(20) == "shared decoder flash-dec announced itself to the hub's SUN router (capacity 16)"
    finally:
        node.stop()
        link.close()
        watch.close()
