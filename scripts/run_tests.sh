#!/usr/bin/env bash
# `make test`'s pytest runs: the suite on two pytest-xdist workers (a file per worker at a time), then
# the tests marked `networks` (RabbitMQ clusters, network namespaces, an sshd device: tests/conftest.py)
# one after another in one process. Run beside the workers they passed once (9m53s in all) and failed
# twice in a second run on a loaded machine (decoders not yet online, no draft after a heal): they
# wait on process start-up that load stretches, so until those waits are events they run alone.
# Usage: scripts/run_tests.sh VENV_BIN [pytest args for both runs]
set -u
bin=$1; shift
STARSUN_STRICT=1 "$bin/python" -m pytest -q --durations=25 -n 2 --dist loadfile -m "not soak and not networks" "$@"
rest=$?
STARSUN_STRICT=1 "$bin/python" -m pytest -q --durations=10 -m networks "$@"
net=$?
[ "$rest" -eq 0 ] && [ "$net" -eq 0 ]
