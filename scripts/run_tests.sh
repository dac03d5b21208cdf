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
# the free disk under the temporary folder every 5 s: a full disk fails tests far from its cause
free_kb=$(mktemp "${TMPDIR:-/tmp}/starsun-free.XXXXXX")
( while :; do df -Pk "${TMPDIR:-/tmp}" | awk 'NR == 2 {print $4}'; sleep 5; done >"$free_kb" ) &
sampler=$!
STARSUN_STRICT=1 "$bin/python" -m pytest -q --durations=10 -m networks "$@" >"$log" 2>&1 &
networks=$!
trap 'kill "$networks" "$sampler" 2>/dev/null; rm -f "$log" "$free_kb"; exit 130' INT TERM
echo "the tests marked networks run beside the workers (pid $networks); their output follows theirs"
STARSUN_STRICT=1 "$bin/python" -m pytest -q --durations=25 -n 2 --dist loadfile --no-loadscope-reorder -m "not soak and not networks" "$@"
rest=$?
wait "$networks"
net=$?
trap - INT TERM
echo "---- the tests marked networks, run beside the rest (exit $net) ----"
cat "$log"
rm -f "$log"
kill "$sampler" 2>/dev/null
awk 'NR == 1 {first = $1; least = $1} $1 < least {least = $1}
     END {printf "free disk under the temporary folder: %.1f GB at the start, %.1f GB at the least (%.1f GB used at the peak)\n", first / 1048576, least / 1048576, (first - least) / 1048576}' "$free_kb"
rm -f "$free_kb"
echo "---- make test: the rest exited $rest, the networks tests $net ----"
[ "$rest" -eq 0 ] && [ "$net" -eq 0 ]
