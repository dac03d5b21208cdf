#!/usr/bin/env bash
# Install the system packages a make target needs when they are missing: via apt when
# run as root, otherwise stop with the exact command to run.
# usage: scripts/ensure_system.sh [compiler] [venv] [mosquitto] [rabbitmq] [ssh] [sshd] [rsync] [netns]
set -euo pipefail
missing=()
for need in "$@"; do
  case $need in
    compiler)  { command -v cc && command -v c++; } >/dev/null 2>&1 || missing+=(build-essential) ;;
    venv)      missing+=(python3-venv) ;;
    cmake)     command -v cmake >/dev/null 2>&1 || missing+=(cmake) ;;   # llama.cpp's own tools (make llama-tools)
    mosquitto) command -v mosquitto >/dev/null 2>&1 || [ -x /usr/sbin/mosquitto ] || missing+=(mosquitto)
               # mosquitto_pub / _sub: third-party clients that attack a live star in the tests
               command -v mosquitto_pub >/dev/null 2>&1 || missing+=(mosquitto-clients) ;;
    # a clustered MQTT broker (RabbitMQ 3.10 + its MQTT plugin): the star on a broker cluster (harness/rabbitmq.py)
    rabbitmq)  [ -x /usr/sbin/rabbitmq-server ] || [ -x /usr/lib/rabbitmq/bin/rabbitmq-server ] \
                 || missing+=(rabbitmq-server) ;;
    # provisioning: ssh + rsync on the PC; the tests' "device" is a real sshd (tests/system/test_flash_jetson.py)
    ssh)       command -v ssh >/dev/null 2>&1 || missing+=(openssh-client) ;;
    sshd)      [ -x /usr/sbin/sshd ] || missing+=(openssh-server) ;;
    rsync)     command -v rsync >/dev/null 2>&1 || missing+=(rsync) ;;
    # ip netns / veth / tc: the star across network namespaces (harness/netns.py)
    netns)     { command -v ip || [ -x /usr/sbin/ip ] || [ -x /sbin/ip ]; } >/dev/null 2>&1 || missing+=(iproute2) ;;
    *) echo "ensure_system.sh: unknown need '$need'" >&2; exit 2 ;;
  esac
done
[ ${#missing[@]} -eq 0 ] && exit 0
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  echo "installing ${missing[*]} (apt)"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
  exit 0
fi
echo "error: this needs ${missing[*]}, which is not installed. Run:" >&2
echo "    sudo apt-get update && sudo apt-get install -y ${missing[*]}" >&2
echo "(or your system's equivalent), then run make again." >&2
exit 1
