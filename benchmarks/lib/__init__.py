"""What the benchmark scripts share and the processes they start; nothing here is a script.

    results              where results go (benchmarks/results/<script>/<variant>.*), ROOT
    server_process       a server process pinned to its cores, waited for on /health, stopped
    chat_client          one /v1/chat/completions request, plain or streamed (TTFT, tokens)
    datasets             MT-bench turns from the registry packages (docs/models.md)
    repetitive_workloads BFCL calls, code edits, multi-turn: prompts where text repeats
    backends_report      engines/backends.py's table, ratios and plot
    starsd_report        star/starsd_scaling.py's planner overlay, plot and table
    two_device_report    star/starsd_two_device.py's table, passes and plot
    constrained_report   star/constrained_speed.py's tables and plot
    constrained_hostile  issue 44's hostile schemas through the star, timed (constrained_speed --hostile)
    starsd_worker        the targets of one scaling point, in their own process (-m)
    memory_workload      one memory case in a fresh process (-m), for device/memory_plan.py
    fault_bench          the faults run's types (Fault, Outcome) and its live-star bench
    faults_network, faults_process, faults_hostile   the faults faults/faults.py runs
    hostile_star         the attackers' side of faults_hostile

The code benchmarks share with the tests (emulated targets, load drivers, tiny models,
namespace stars) is the top-level `harness` package.
"""
