#!/usr/bin/env bash
# `make test`'s pytest runs: the suite on two pytest-xdist workers (a file per worker at a time) and,
# beside them in one more process, the tests marked `networks` (RabbitMQ clusters, network
# namespaces, an sshd device: tests/conftest.py), one after another -- they mostly wait on processes
# starting, so they cost the two workers little, and never run two at once. Both runs count. They
# wait on events, not on start-up time (a router that routes to its workers, drafting seen again
# after a heal), so the load of the workers beside them slows them down but does not fail them.
# The workers take the files in collection order (--no-loadscope-reorder), which tests/conftest.py
# starts with the slowest files, so the last files to start are short ones.
# The networks run's output goes to a file, printed after the workers' once both are done.
# Usage: scripts/run_tests.sh VENV_BIN [pytest args for both runs]
set -u
bin=$1; shift
log=$(mktemp "${TMPDIR:-/tmp}/starsun-networks.XXXXXX")
STARSUN_STRICT=1 "$bin/python" -m pytest -q --durations=10 -m networks "$@" >"$log" 2>&1 &
networks=$!
trap 'kill "$networks" 2>/dev/null; rm -f "$log"; exit 130' INT TERM
echo "the tests marked networks run beside the workers (pid $networks); their output follows theirs"
STARSUN_STRICT=1 "$bin/python" -m pytest -q --durations=25 -n 2 --dist loadfile --no-loadscope-reorder -m "not soak and not networks" "$@"
rest=$?
wait "$networks"
net=$?
trap - INT TERM
echo "---- the tests marked networks, run beside the rest (exit $net) ----"
cat "$log"
rm -f "$log"
echo "---- make test: the rest exited $rest, the networks tests $net ----"
[ "$rest" -eq 0 ] && [ "$net" -eq 0 ]
