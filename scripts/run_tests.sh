#!/usr/bin/env bash
# `make test`'s pytest runs: the suite on two pytest-xdist workers (a file per worker at a time) and,
# beside them in one more process, the tests marked `networks` (RabbitMQ clusters, network
# namespaces, an sshd device: tests/conftest.py), one after another -- they mostly wait on
# processes starting, so they cost the two workers little, and never run two at once.
# Usage: scripts/run_tests.sh VENV_BIN [pytest args for both runs]
set -u
bin=$1; shift
log=$(mktemp)
STARSUN_STRICT=1 "$bin/python" -m pytest -q --durations=10 -m networks "$@" >"$log" 2>&1 &
networks=$!
STARSUN_STRICT=1 "$bin/python" -m pytest -q --durations=25 -n 2 --dist loadfile -m "not soak and not networks" "$@"
rest=$?
wait "$networks"
net=$?
echo "---- the tests marked networks, run beside the rest (exit $net) ----"
cat "$log"
rm -f "$log"
[ "$rest" -eq 0 ] && [ "$net" -eq 0 ]
