#!/usr/bin/env bash
# A private Docker engine for the container tests: dockerd with its socket, data root and
# exec root under one temporary directory, started in the background and stopped by PID.
#
#   scripts/dockerd.sh start DIR   install docker.io if missing (root + apt), start dockerd,
#                                  wait until it answers; prints DOCKER_HOST=unix://DIR/docker.sock
#   scripts/dockerd.sh stop DIR    remove every container of that engine, stop dockerd by
#                                  the PID in DIR/dockerd.pid, remove DIR
#
# The engine makes no bridge and touches no iptables rule (--bridge=none --iptables=false):
# every container of this project uses host networking and binds 127.0.0.1 only.
set -euo pipefail

action=${1:?usage: dockerd.sh start|stop DIR}
dir=${2:?usage: dockerd.sh start|stop DIR}
sock="$dir/docker.sock"
pidfile="$dir/dockerd.pid"

docker_cli() {
  # The docker.io client next to dockerd (another `docker` earlier on PATH may be newer
  # than this daemon's API).
  local cli
  cli="$(dirname "$(command -v dockerd)")/../bin/docker"
  [ -x "$cli" ] || cli=$(command -v docker)
  "$cli" -H "unix://$sock" "$@"
}

case "$action" in
start)
  if ! command -v dockerd >/dev/null; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
      echo "dockerd.sh: apt-get install docker.io" >&2
      apt-get update -qq
      DEBIAN_FRONTEND=noninteractive apt-get install -y -qq docker.io >/dev/null
    else
      echo "dockerd.sh: dockerd is missing and cannot be installed (needs root and apt-get)" >&2
      exit 1
    fi
  fi
  mkdir -p "$dir"
  chmod 0700 "$dir"
  if [ -f "$pidfile" ] && kill -0 "$(cat "$pidfile")" 2>/dev/null; then
    echo "DOCKER_HOST=unix://$sock"
    exit 0
  fi
  # setsid: the daemon outlives this script but not `stop`.
  setsid dockerd -H "unix://$sock" --data-root "$dir/data" --exec-root "$dir/exec" \
    --pidfile "$pidfile" --bridge=none --iptables=false --ip6tables=false \
    >"$dir/dockerd.log" 2>&1 </dev/null &
  for _ in $(seq 1 300); do
    if docker_cli version >/dev/null 2>&1; then
      echo "DOCKER_HOST=unix://$sock"
      exit 0
    fi
    sleep 0.1
  done
  echo "dockerd.sh: dockerd did not answer on $sock within 30s; its log:" >&2
  tail -n 30 "$dir/dockerd.log" >&2
  exit 1
  ;;
stop)
  if [ -f "$pidfile" ]; then
    pid=$(cat "$pidfile")
    ids=$(docker_cli ps -aq 2>/dev/null || true)
    [ -z "$ids" ] || docker_cli rm -f $ids >/dev/null 2>&1 || true
    kill "$pid" 2>/dev/null || true
    for _ in $(seq 1 150); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    kill -9 "$pid" 2>/dev/null || true
  fi
  # dockerd leaves its overlay mounts under the data root mounted if killed hard.
  if [ -d "$dir" ]; then
    grep -o " $dir/[^ ]*" /proc/self/mounts | sort -r | xargs -r -n1 umount -l 2>/dev/null || true
    rm -rf "$dir"
  fi
  ;;
*)
  echo "usage: dockerd.sh start|stop DIR" >&2
  exit 2
  ;;
esac
