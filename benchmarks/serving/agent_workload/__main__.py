"""`python -m benchmarks.serving.agent_workload`: the run (see the package's docstring)."""
from benchmarks.serving.agent_workload.runner import main

main()
