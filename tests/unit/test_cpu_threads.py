"""The thread count a CPU engine takes when not told (edge/engines/cpu_threads.py): one per physical
core it may run on: hyperthreads of one core count once, cores outside its affinity not at all
(tests/engines/test_llamacpp_default_threads.py: a llama.cpp context takes it)."""
from __future__ import annotations

from edge.engines import cpu_threads
from edge.engines.cpu_threads import default_threads, physical_cores


def _topology(tmp_path, siblings: dict):
    for cpu, sib in siblings.items():
        d = tmp_path / f"cpu{cpu}" / "topology"
        d.mkdir(parents=True)
        (d / "thread_siblings_list").write_text(sib + "\n")
    return tmp_path


def test_hyperthreads_of_one_core_count_once(tmp_path):
    sys_cpu = _topology(tmp_path, {0: "0,2", 1: "1,3", 2: "0,2", 3: "1,3"})
    assert physical_cores([0, 1, 2, 3], sys_cpu) == 2
    assert physical_cores([0, 2], sys_cpu) == 1          # both threads of core 0


def test_cpus_without_topology_count_one_each(tmp_path):
    assert physical_cores([0, 1, 5], tmp_path) == 3
    assert physical_cores([], tmp_path) == 1


def test_default_follows_the_affinity(tmp_path, monkeypatch):
    sys_cpu = _topology(tmp_path, {0: "0", 1: "1", 2: "2", 3: "3"})
    monkeypatch.setattr(cpu_threads, "_SYS_CPU", sys_cpu)
    monkeypatch.setattr(cpu_threads, "allowed_cpus", lambda: {1, 3})       # e.g. taskset -c 1,3
    assert default_threads() == 2
    monkeypatch.setattr(cpu_threads, "allowed_cpus", lambda: {2})
    assert default_threads() == 1
