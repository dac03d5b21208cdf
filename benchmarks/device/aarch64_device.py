"""The kit on the Jetson's architecture without a Jetson: `make flash-jetson` into an arm64 Debian
root run by qemu-user on this x86 machine, until its agent joins a hub here and decodes the same
greedy text as the same model natively (issue 35, point 10).

Too slow for `make test`: a person runs it, as root, from the repository root:

  python -m benchmarks.device.aarch64_device                 # ~30-60 min on 2 shared cores
  python -m benchmarks.device.aarch64_device --fresh        # a new root and device venv (+4 min)
  python -m benchmarks.device.aarch64_device --remove-root  # and delete the root afterwards

Steps (each prints its progress and time):
 1. the host's tools and binfmt_misc (benchmarks/device/_aarch64_root.py says what it changes);
 2. the arm64 root (debootstrap, minutes; reused from /var/tmp/starsun-aarch64 the next time),
    its mounts and an sshd on a loopback port, as user `nvidia`;
 3. the artifact: SmolLM2-135M as an fp32 ONNX bundle (edge-export bundle; onnxruntime has
    aarch64 wheels on PyPI, llama-cpp-python would compile from source for hours under qemu);
 4. a hub here (`edge-hub serve --mosquitto`, its draft SmolLM2 GGUF on llama.cpp);
 5. the x86 reference: a target on this machine, same bundle, same hub, one greedy request;
 6. `make flash-jetson` of a target to the root (profile cpu-2core, --backend onnx, --deps pypi:
    the device's pip fetches aarch64 wheels); no systemd runs there, so the script starts the
    unit's ExecStart over ssh when step 9 of provisioning says so, and provisioning waits for the
    join and then, on the device over the same ssh, until the target's OpenAI endpoint answers
    (devices/endpoint_wait.py: under qemu the agent opens it long after it joins, and a request
    in between was refused);
 7. the same greedy request to the device's OpenAI endpoint (once step 6 saw it answer); the
    texts compared;
 8. the wheels pip chose on the device (each dist-info's WHEEL tag) and the venv's size.
Everything started is stopped, and everything mounted unmounted, even on failure or Ctrl-C.
Writes <out>.json and <out>.md (default /var/tmp/starsun-aarch64/result).
"""
from __future__ import annotations

import argparse
import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

from benchmarks.device._aarch64_root import Arm64Root
from benchmarks.lib.results import ROOT
from harness.ssh_device import free_port

WORK = Path("/var/tmp/starsun-aarch64")
MODEL = "smollm2-135m"
PROMPT = "Name three colours of the rainbow."
START = "start the agent now with: "


class Lines:
    """A process whose stdout+stderr are read line by line as they come (and echoed, indented)."""

    def __init__(self, argv, name: str, echo: bool = True, **kw):
        self.name, self.out, self.q = name, "", queue.Queue()
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     start_new_session=True, **kw)
        threading.Thread(target=self._pump, args=(echo,), daemon=True).start()

    def _pump(self, echo: bool) -> None:
        for line in self.proc.stdout:
            if echo:
                print(f"    {self.name}| {line}", end="", flush=True)
            self.q.put(line)
        self.q.put(None)

    def until(self, pattern: str, timeout: float) -> re.Match:
        end = time.monotonic() + timeout
        while not (m := re.search(pattern, self.out)):
            try:
                line = self.q.get(timeout=max(0.1, end - time.monotonic()))
            except queue.Empty:
                raise TimeoutError(f"{self.name}: no {pattern!r} within {timeout:.0f} s") from None
            if line is None:
                raise RuntimeError(f"{self.name} exited ({self.proc.wait()}) before {pattern!r}")
            self.out += line
        return m

    def finish(self, timeout: float) -> int:
        rc = self.proc.wait(timeout)
        while (line := self.q.get(timeout=10)) is not None:
            self.out += line
        return rc

    def stop(self) -> None:
        """SIGTERM to the process group this script started, SIGKILL after 15 s."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(5)


def chat(port: int, max_tokens: int, timeout: float) -> dict:
    """One greedy chat completion from a target's OpenAI endpoint, timed."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": max_tokens,
            "temperature": 0}
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    t0 = time.monotonic()
    with urllib.request.urlopen(req, timeout=timeout) as r:
        ans = json.loads(r.read())
    return {"text": ans["choices"][0]["message"]["content"], "usage": ans.get("usage"),
            "seconds": round(time.monotonic() - t0, 1)}


def ensure_bundle(work: Path) -> Path:
    """SmolLM2-135M as an fp32 ONNX bundle, exported once (torch here; the device needs no torch)."""
    out = work / "bundle-fp32"
    if not (out / "manifest.json").is_file():
        subprocess.run([str(ROOT / ".venv/bin/edge-export"), "bundle", MODEL, str(out), "--onnx", "model"],
                       check=True)
    return out


def start_hub(port: int) -> Lines:
    hub = Lines([str(ROOT / ".venv/bin/edge-hub"), "serve", "--mosquitto", "--port", str(port), "--hub-id", "armhub",
                 "--draft-model", MODEL, "--draft-backend", "llamacpp", "--stats-every", "0"], "hub")
    hub.until(r"hub armhub serving on", timeout=300)
    return hub


def x86_reference(bundle: Path, hub_url: str, max_tokens: int) -> dict:
    """The same bundle on this machine's onnxruntime, through the same hub and endpoint."""
    port = free_port()
    agent = Lines([str(ROOT / ".venv/bin/edge-agent"), "run", "--role", "target", "--model", str(bundle),
                   "-b", "onnx", "--broker", hub_url, "--client-id", "x86-ref", "--max-len", "512",
                   "--http-port", str(port)], "x86")
    try:
        agent.until(r"OpenAI endpoint on", timeout=300)
        return chat(port, max_tokens, timeout=600)
    finally:
        agent.stop()


def flash(root: Arm64Root, bundle: Path, hub_url: str, http_port: int, join_timeout: float, agents: list) -> Lines:
    """make flash-jetson to the root; starts the unit's ExecStart over ssh when provisioning asks."""
    args = (f"--ssh-config {root.ssh_config} --backend onnx --timeout {join_timeout:.0f} "
            f"--set http_port={http_port} --device-python python3")
    prov = Lines(["make", "--no-print-directory", "flash-jetson", f"SSH={root.alias}", "PROFILE=cpu-2core",
                  "ROLE=target", f"BROKER={hub_url}", f"BUNDLE={bundle}", "CLIENT_ID=arm64-target", "MAX_LEN=512",
                  f"ARGS={args}"], "flash", cwd=ROOT)
    cmd = prov.until(START + r"(.*?) \([\d.]+ s\)\n", timeout=7200).group(1)     # the step's time follows
    agents.append(root.run_as_user(cmd, root.home / "starsun/agent.log"))   # what systemd would start
    print(f"  started the agent on the device (pid {agents[-1].pid}): {cmd}", flush=True)
    if prov.finish(timeout=join_timeout + 600) != 0:
        log = (root.home / "starsun/agent.log")
        raise RuntimeError("make flash-jetson failed" + (f"; the agent's log:\n{log.read_text()[-3000:]}"
                                                         if log.is_file() else ""))
    if f"its OpenAI endpoint answers on the device: GET http://127.0.0.1:{http_port}/" not in prov.out:
        raise RuntimeError(f"make flash-jetson ended without seeing the endpoint on :{http_port} answer")
    return prov


def chosen_wheels(root: Arm64Root) -> dict:
    """Each distribution in the device's venv and the tag of the wheel pip installed it from."""
    out = {}
    for info in sorted((root.home / "starsun/venv/lib").glob("python3*/site-packages/*.dist-info")):
        wheel = info / "WHEEL"
        tags = [ln.split(":", 1)[1].strip() for ln in wheel.read_text().splitlines()
                if ln.startswith("Tag:")] if wheel.is_file() else []
        out[info.name[:-len(".dist-info")]] = ", ".join(tags) or "(no WHEEL file)"
    return out


def write_report(out: Path, result: dict) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
    r = result
    lines = ["# The kit on aarch64 (qemu-user on x86), provisioned by `make flash-jetson`", "",
             f"Machine: {r['host']}. Device: {r.get('device')}. Model: {MODEL} fp32 ONNX bundle, "
             f"greedy, {r['max_tokens']} tokens, prompt {PROMPT!r}. Command: `{r['command']}`.", "",
             f"**Same greedy text as x86: {r.get('same_text')}**", "",
             f"* x86 ({r.get('x86', {}).get('seconds')} s): {r.get('x86', {}).get('text')!r}",
             f"* aarch64 ({r.get('aarch64', {}).get('seconds')} s): {r.get('aarch64', {}).get('text')!r}",
             f"* device venv: {r.get('venv')}", "", "| step | seconds |", "|---|---|"]
    lines += [f"| {k} | {v} |" for k, v in r["steps"].items()]
    lines += ["", "Wheels pip chose on the device:", "", "| distribution | wheel tag |", "|---|---|"]
    lines += [f"| {k} | {v} |" for k, v in r.get("wheels", {}).items()]
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")


class Run:
    """The steps in order, each timed; close() gives everything back."""

    def __init__(self, a):
        self.a, self.steps, self.hub, self.agents = a, {}, None, []
        self.root = Arm64Root(a.work / "root", say=lambda s: print(s, flush=True))
        self.result = {"command": " ".join(["python -m benchmarks.device.aarch64_device", *sys.argv[1:]]),
                       "host": f"{os.uname().machine}, {os.cpu_count()} cores", "max_tokens": a.max_tokens,
                       "steps": self.steps}

    def step(self, name: str, fn):
        print(f"[{len(self.steps) + 1}] {name} ...", flush=True)
        t0 = time.monotonic()
        value = fn()
        self.steps[name] = round(time.monotonic() - t0, 1)
        print(f"    {value if isinstance(value, str) else 'done'} ({self.steps[name]} s)", flush=True)
        return value

    def go(self) -> dict:
        a, r, root = self.a, self.result, self.root
        self.step("host tools", root.ensure_tools)
        self.step("binfmt_misc", root.ensure_binfmt)
        if a.fresh and root.path.exists():
            self.step("remove the old root (--fresh)", root.remove)
        self.step("arm64 root", root.bootstrap)
        self.step("mounts", root.mount)
        self.step("sshd in the root", root.start_sshd)
        facts = "uname -sm; python3 --version"
        r["device"] = self.step("device facts", lambda: root.ssh(facts).strip().replace("\n", ", "))
        bundle = self.step("ONNX bundle", lambda: ensure_bundle(a.work))
        port = free_port()
        hub_url = f"mqtt://127.0.0.1:{port}"
        self.hub = self.step("hub", lambda: start_hub(port))
        r["x86"] = self.step("x86 reference", lambda: x86_reference(bundle, hub_url, a.max_tokens))
        http_port = free_port()
        prov = self.step("make flash-jetson", lambda: flash(root, bundle, hub_url, http_port, a.join_timeout,
                                                              self.agents))
        r["venv"] = next(iter(re.findall(r"the venv takes \d+ MiB", prov.out)), "not reported")
        r["flash_output"] = [ln for ln in prov.out.splitlines() if re.match(r"\s*(\[\d+/10\]|\(|.*provisioned)", ln)
                             or "MiB" in ln or "joined" in ln or "OpenAI endpoint" in ln]
        r["aarch64"] = self.step("aarch64 greedy request", lambda: chat(http_port, a.max_tokens, a.request_timeout))
        r["same_text"] = r["aarch64"]["text"] == r["x86"]["text"]
        r["wheels"] = self.step("wheels on the device", lambda: chosen_wheels(root))
        return r

    def close(self) -> None:
        for agent in self.agents:
            if agent.poll() is None:
                agent.terminate()
                agent.wait(30)
        if self.hub is not None:
            self.hub.stop()
        for note in self.root.close(remove=self.a.remove_root):
            print(f"  cleanup: {note}", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--work", type=Path, default=WORK, help="the root, keys and bundle live here (not the repo)")
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--join-timeout", type=float, default=1800, help="seconds provisioning waits for the join "
                    "and the endpoint (its --timeout)")
    ap.add_argument("--request-timeout", type=float, default=1800, help="seconds for the device's answer")
    ap.add_argument("--fresh", action="store_true", help="delete a root left by an earlier run first (its venv "
                    "and pip cache too): everything from debootstrap on, as a new device")
    ap.add_argument("--remove-root", action="store_true", help="delete the arm64 root at the end")
    ap.add_argument("--out", type=Path, default=None, help="report stem (default WORK/result)")
    a = ap.parse_args()
    if os.geteuid() != 0:
        sys.exit("run it as root: it mounts binfmt_misc, /proc etc. into the root and chroots")
    run, t0 = Run(a), time.monotonic()
    try:
        result = run.go()
    except KeyboardInterrupt:
        result = {**run.result, "error": "interrupted"}
    except Exception as e:          # the report says which step failed and why; cleanup still runs
        result = {**run.result, "error": f"{type(e).__name__}: {e}"}
    finally:
        run.close()
    result["wall_s"] = round(time.monotonic() - t0, 1)
    out = a.out or a.work / "result"
    write_report(out, result)
    print(f"same greedy text as x86: {result.get('same_text')}; wall {result['wall_s']} s; "
          f"{result.get('venv')}; report {out}.md" + (f"\nFAILED: {result['error']}" if "error" in result else ""))
    return 0 if result.get("same_text") else 1


if __name__ == "__main__":
    sys.exit(main())
