"""benchmarks/serving/agent_workload/ without a model: its options (--quick and what overrides it),
the cells a server runs, the checkpoint a rerun resumes from (and --redo's cells dropped from it),
and the report of a partial run."""
import json

import pytest

from benchmarks.serving import agent_workload as aw


def test_defaults_are_the_full_run():
    a = aw.args_of([])
    assert a.models == list(aw.MODELS) and a.servers == list(aw.SERVERS)
    assert (a.cases, a.turns, a.sessions, a.clients, a.requests, a.parallel) == (100, 5, 3, 4, 4, 4)
    assert aw.args_of(["--clients", "2"]).parallel == 2 and aw.args_of(["--parallel", "1"]).parallel == 1
    assert a.out.name == "default" and a.out.parent.name == "agent_workload"
    assert aw.part_keys(a) == ["multiturn", "concurrent", "serial", "bfcl_simple", "bfcl_multiple", "bfcl_parallel"]


def test_quick_is_small_and_what_is_given_wins():
    q = aw.args_of(["--quick"])
    assert (q.cases, q.models, q.turns, q.sessions, q.requests) == (10, [aw.MODELS[0]], 2, 1, 1)
    assert q.out.name == "smoke"
    q = aw.args_of(["--quick", "--cases", "20", "--models=qwen2.5-coder-1.5b", "--out", "/tmp/x/y"])
    assert q.cases == 20 and q.models == ["qwen2.5-coder-1.5b"] and str(q.out) == "/tmp/x/y"
    assert aw.part_keys(aw.args_of(["--parts", "bfcl", "--categories", "parallel"])) == ["bfcl_parallel"]


@pytest.mark.parametrize("bad", [["--servers", "vllm"], ["--parts", "speed"], ["--categories", "live"],
                                 ["--turns", "9"], ["--cases", "0"], ["--parallel", "0"],
                                 ["--server-core", "2"]])
def test_bad_options_are_refused(bad):
    with pytest.raises(SystemExit):
        aw.args_of(bad)


def test_the_checkpoint_resumes_and_a_partial_run_reports(tmp_path):
    out = tmp_path / "agent_workload" / "amd_1.5b_partial"     # a dot in the name is not a suffix
    store = aw.Store(out.with_name(out.name + ".json"))
    store.data["config"] = {k: str(v) if k == "out" else v for k, v in vars(aw.args_of(["--quick"])).items()}
    cell = store.cell("llama-server", aw.MODELS[0], "bfcl_simple")
    cell["cases"] = {"simple_python_0": {"ok": True, "why": None, "s": 1.0}}
    store.cell("ours", aw.MODELS[0], "concurrent").update(done=True, summary={
        "clients": 4, "requests": 4, "failed": 0, "tok_s": 10.0, "p50_s": 1.0, "p99_s": 2.0,
        "ttft_p50_s": 0.5, "server_parallel": 1})
    store.cell("ours", aw.MODELS[0], "serial").update(done=True, summary={"tok_s": 8.0, "cpu_ms_per_token": 70.04})
    store.save()
    again = aw.Store(out.with_name(out.name + ".json"))
    assert again.done("ours", aw.MODELS[0], "concurrent") and not again.done("llama-server", aw.MODELS[0], "bfcl_simple")
    assert json.loads(out.with_name(out.name + ".json").read_text())["cells"][f"llama-server|{aw.MODELS[0]}|bfcl_simple"]
    aw.write_report(again.data, out)
    md = out.with_name(out.name + ".md").read_text()
    assert "(1/1 so far)" in md and out.with_name(out.name + ".png").exists()
    assert "| 1 | 10.00 | - | 1.00 | 2.00 | 0.50 | 0/4 | - | 8.00 | 70.0 | - | - | - | 1.25x |" in md  # no CPU: -


def test_redo_drops_the_matching_cells_only(tmp_path):
    store = aw.Store(tmp_path / "x.json")
    for key in ("ours|m|concurrent", "ours|m|multiturn", "ours-star|m|concurrent", "llama-server|m|bfcl_simple",
                "ours|n|bfcl_simple"):
        server, model, part = key.split("|")
        store.cell(server, model, part)["done"] = True
    assert store.drop(["ours|*|concurrent"]) == ["ours|m|concurrent"]
    assert sorted(store.drop(["ours*|*|bfcl_*", "nothing"])) == ["ours|n|bfcl_simple"]
    assert sorted(store.data["cells"]) == ["llama-server|m|bfcl_simple", "ours-star|m|concurrent", "ours|m|multiturn"]


def test_two_runs_sharing_one_result_file_keep_each_others_cells(tmp_path):
    path = tmp_path / "shared.json"
    a, b = aw.Store(path), aw.Store(path)           # say llama-server on core 1, ours on core 0
    a.data["runs"].append({"started": "t0", "argv": ["--servers", "llama-server"]})
    b.data["runs"].append({"started": "t1", "argv": ["--servers", "ours"]})
    a.cell("llama-server", "m", "bfcl_simple")["cases"] = {"c0": {"ok": False}}
    a.save()
    b.cell("ours", "m", "bfcl_simple")["cases"] = {"c0": {"ok": True}}
    b.save()                                         # adopts a's cell, keeps its own
    a.cell("llama-server", "m", "bfcl_simple")["cases"]["c1"] = {"ok": True}
    a.data["runs"][-1]["finished"] = "t2"            # its own run, changed since: not a second run
    a.save()
    disk = json.loads(path.read_text())
    assert disk["cells"]["ours|m|bfcl_simple"]["cases"] == {"c0": {"ok": True}}
    assert sorted(disk["cells"]["llama-server|m|bfcl_simple"]["cases"]) == ["c0", "c1"]
    assert [r["started"] for r in disk["runs"]] == ["t1", "t0"] and disk["runs"][1]["finished"] == "t2"
    assert aw.args_of(["--server-core", "1"]).server_core == 1


def test_repack_reaches_ours_command_lines_only_when_asked(monkeypatch, tmp_path):
    """--repack on|off goes to ours alone (agent_alone_worker) and the star's `edge-agent run`; auto
    leaves their command lines as they were (a recorded command stays the default's)."""
    from benchmarks.serving.agent_workload import servers
    monkeypatch.setattr(servers.Server, "_spawn", lambda self, argv: setattr(self, "argv", [str(a) for a in argv]))
    monkeypatch.setattr(servers.Server, "wait_ready", lambda self, timeout=0: None)
    assert aw.args_of([]).repack == "auto"
    with pytest.raises(SystemExit):
        aw.args_of(["--repack", "maybe"])
    for mode, want in (("auto", []), ("on", ["--repack", "on"]), ("off", ["--repack", "off"])):
        ours = servers.make_server("ours", aw.MODELS[0], 1, aw.args_of(["--repack", mode]), {"logdir": tmp_path})
        ours.start()
        assert ours.argv[-len(want) - 2:] == ["--parallel", "4", *want]


def test_the_report_shows_every_stored_cell_not_only_the_last_runs(tmp_path):
    store = aw.Store(tmp_path / "r.json")
    store.data["config"] = {k: str(v) if k == "out" else v
                            for k, v in vars(aw.args_of(["--models", aw.MODELS[1], "--servers", "ours-star"])).items()}
    for server, model, ok in (("llama-server", aw.MODELS[0], 0), ("ours", aw.MODELS[1], 1)):
        store.cell(server, model, "bfcl_simple").update(done=True, summary={
            "passed": ok, "n": 1, "accuracy": float(ok), "no_calls": 1 - ok, "median_s": 1.0})
    aw.write_report(store.data, tmp_path / "r")
    md = (tmp_path / "r.md").read_text()
    assert f"| {aw.MODELS[0]} | llama-server | 0/1 (0%) |" in md and f"| {aw.MODELS[1]} | ours | 1/1 (100%) |" in md
    assert "-np 4`" in md                            # the header's f-strings filled in


def test_the_interleaved_part_runs_when_named_and_reports_its_turns(tmp_path):
    a = aw.args_of(["--parts", "interleaved", "--conversations", "3", "--prompt-cache-ram", "0"])
    assert aw.part_keys(a) == ["interleaved"] and a.conversations == 3 and a.prompt_cache_ram == 0.0
    assert "interleaved" not in aw.part_keys(aw.args_of([]))
    from benchmarks.serving.agent_workload.servers import make_server
    ctx = {"logdir": tmp_path, "bin_dir": lambda: tmp_path}
    assert make_server("ours", aw.MODELS[0], 1, a, ctx).ram == 0.0
    from benchmarks.serving.agent_workload.interleaved import _messages
    msgs = _messages("SYS", 1, [{"answer": "one"}])
    assert msgs[0]["content"].startswith("Conversation 2 of") and [m["role"] for m in msgs] == \
        ["system", "user", "assistant", "user"]
    from benchmarks.serving.agent_workload.report import write_report
    out = tmp_path / "r"
    write_report({"config": {"conversations": 3, "prefix_tokens": 1800, "turn_tokens": 64, "models": [aw.MODELS[0]],
                             "servers": ["ours"]},
                  "cells": {f"ours|{aw.MODELS[0]}|interleaved": {"done": True, "summary": {
                      "ttft_s": [9.0, 0.5, 0.4], "prompt_tokens": [1800, 1900, 2000], "cached_tokens": [0, 1850, 1950],
                      "total_s": 40.0}}}}, out)
    md = (tmp_path / "r.md").read_text()
    assert "| 9.00 | 0.50 | 0.40 | 1800 / 1900 / 2000 | 0 / 1850 / 1950 | 40.00 |" in md
