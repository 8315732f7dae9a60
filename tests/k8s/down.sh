#!/usr/bin/env bash
# down.sh [LAB_DIR] [--wipe]
#
# Stops exactly the processes control-plane.sh (and fake-node.sh) started: the PIDs recorded in
# LAB_DIR/run/*.pid (fake-node heartbeats, kube-scheduler, kube-controller-manager, then
# kube-apiserver, then etcd). A PID is signalled only if it is alive and its command line still
# mentions LAB_DIR (guards against PID reuse).
# SIGTERM first, SIGKILL after ${STOP_TIMEOUT_S:-20}s. Data (etcd), certs and logs are kept;
# `down.sh LAB_DIR --wipe` (or WIPE=1) also deletes LAB_DIR/data for a fresh cluster next control-plane.sh.
# LAB_DIR defaults to the directory this script is in.
set -euo pipefail

WIPE=${WIPE:-0}
args=()
for a in "$@"; do
  case "$a" in
    --wipe) WIPE=1 ;;
    *) args+=("$a") ;;
  esac
done
LAB=${args[0]:-${LAB_DIR:?usage: down.sh LAB_DIR [--wipe]}}
LAB=$(cd "$LAB" && pwd)
RUN=$LAB/run
STOP_TIMEOUT_S=${STOP_TIMEOUT_S:-20}

log() { echo "[down $(date +%H:%M:%S)] $*"; }

ours() {  # ours PID: alive and its cmdline mentions LAB (a path under it, or LAB itself as an argument)
  kill -0 "$1" 2>/dev/null || return 1
  local cmd
  cmd="$(tr '\0' ' ' < "/proc/$1/cmdline" 2>/dev/null) "
  [[ "$cmd" == *"$LAB/"* || "$cmd" == *" $LAB "* ]]
}

stop() {
  local name=$1 f=$RUN/$1.pid pid i
  if [ ! -f "$f" ]; then log "$name: no pid file"; return 0; fi
  pid=$(cat "$f" 2>/dev/null || true)
  if ! [[ "$pid" =~ ^[0-9]+$ ]]; then log "$name: bad pid file"; rm -f "$f"; return 0; fi
  if ! ours "$pid"; then log "$name: pid $pid not running (or not ours)"; rm -f "$f"; return 0; fi
  kill -TERM "$pid"
  for i in $(seq 1 $((STOP_TIMEOUT_S * 10))); do
    ours "$pid" || break
    sleep 0.1
  done
  if ours "$pid"; then
    log "$name: pid $pid ignored SIGTERM, sending SIGKILL"
    kill -KILL "$pid" || true
    sleep 0.5
  fi
  rm -f "$f"
  log "$name: stopped pid $pid"
}

for f in "$RUN"/fake-node-*.pid; do
  [ -e "$f" ] || continue
  n=$(basename "$f" .pid); stop "$n"
done
stop kube-scheduler
stop kube-controller-manager
stop kube-apiserver
stop etcd

if [ "$WIPE" = 1 ]; then
  rm -rf "$LAB/data"
  log "wiped $LAB/data"
fi
