#!/usr/bin/env bash
# fake-node.sh start|stop|beat NAME [LAB_DIR]
#
# A kubelet-less fake Node for scheduling tests:
#   start: create the Node, patch its status subresource (Ready=True, capacity and
#          allocatable cpu=64 memory=512Gi pods=110), then keep heart-beating it every
#          ${BEAT_S:-5}s in a detached loop (PID in LAB_DIR/run/fake-node-NAME.pid) so the
#          node-lifecycle controller never marks it NotReady/unreachable.
#   beat:  one status patch (what the loop does).
#   stop:  stop the heartbeat loop (the Node object stays; delete it with kubectl).
# down.sh also stops any heartbeat loops it finds in run/.
# The API calls go through curl with the lab's admin certificate (LAB_DIR/pki): a heartbeat runs for
# the lab's whole life, and a curl costs a fifth of the CPU a kubectl start does.
set -euo pipefail
cmd=${1:?usage: fake-node.sh start|stop|beat NAME [LAB_DIR]}
NAME=${2:?node name}
LAB=${3:?LAB_DIR (the directory given to control-plane.sh)}
LAB=$(cd "$LAB" && pwd)
PIDF=$LAB/run/fake-node-$NAME.pid
SELF=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/fake-node.sh
SERVER=$(sed -n 's/^ *server: *//p' "$LAB/kubeconfig" | head -1)
PKI=$LAB/pki

api() {  # api METHOD PATH CONTENT-TYPE BODY: the response body; fails on an HTTP error but 409 (exists)
  local out code
  out=$(curl -sS --max-time 10 --cacert "$PKI/ca.crt" --cert "$PKI/admin.crt" --key "$PKI/admin.key" \
    -X "$1" -H "Content-Type: $3" -H "Accept: application/json" --data-binary "$4" \
    -w '\n%{http_code}' "$SERVER$2") || return 1
  code=${out##*$'\n'}
  if [ "$code" -ge 400 ] && [ "$code" != 409 ]; then echo "$1 $2: HTTP $code: ${out%$'\n'*}" >&2; return 1; fi
}

beat() {
  local now
  TZ=UTC printf -v now '%(%Y-%m-%dT%H:%M:%SZ)T' -1
  api PATCH "/api/v1/nodes/$NAME/status" application/merge-patch+json "{\"status\":{
    \"conditions\":[{\"type\":\"Ready\",\"status\":\"True\",\"reason\":\"KubeletReady\",\"message\":\"fake node heartbeat\",
                     \"lastHeartbeatTime\":\"$now\",\"lastTransitionTime\":\"$now\"}],
    \"capacity\":{\"cpu\":\"64\",\"memory\":\"512Gi\",\"pods\":\"110\"},
    \"allocatable\":{\"cpu\":\"64\",\"memory\":\"512Gi\",\"pods\":\"110\"}}}"
}

case "$cmd" in
  start)
    api POST /api/v1/nodes application/json "{\"apiVersion\":\"v1\",\"kind\":\"Node\",\"metadata\":{\"name\":\"$NAME\",
      \"labels\":{\"kubernetes.io/hostname\":\"$NAME\",\"kubernetes.io/os\":\"linux\",\"kubernetes.io/arch\":\"amd64\"}}}"
    beat
    if [ -f "$PIDF" ] && kill -0 "$(cat "$PIDF")" 2>/dev/null; then
      echo "heartbeat already running: pid $(cat "$PIDF")"; exit 0
    fi
    setsid bash -c 'echo $$ > "$0"; exec "$1" loop "$2" "$3"' "$PIDF" "$SELF" "$NAME" "$LAB" \
      > "$LAB/logs/fake-node-$NAME.log" 2>&1 < /dev/null &
    for _ in $(seq 1 50); do [ -s "$PIDF" ] && break; sleep 0.1; done
    echo "heartbeat for node $NAME: pid $(cat "$PIDF")"
    ;;
  loop)
    # the sleep runs in the background + wait so that SIGTERM ends the loop at once
    trap 'exit 0' TERM INT
    while true; do beat || echo "$(date -Is) beat failed"; sleep "${BEAT_S:-5}" & wait $!; done
    ;;
  beat) beat ;;
  stop)
    if [ -f "$PIDF" ]; then
      pid=$(cat "$PIDF")
      cmdl="$(tr '\0' ' ' < "/proc/$pid/cmdline" 2>/dev/null) "
      if kill -0 "$pid" 2>/dev/null && [[ "$cmdl" == *" $LAB "* || "$cmdl" == *"$LAB/"* ]]; then
        kill -TERM "$pid"; echo "stopped heartbeat pid $pid"
      fi
      rm -f "$PIDF"
    fi
    ;;
  *) echo "unknown command $cmd" >&2; exit 2 ;;
esac
