#!/usr/bin/env bash
# fake-node.sh start|stop|beat NAME [LAB_DIR]
#
# A kubelet-less fake Node for scheduling tests:
#   start: kubectl apply the Node, patch its status subresource (Ready=True, capacity and
#          allocatable cpu=64 memory=512Gi pods=110), then keep heart-beating it every
#          ${BEAT_S:-5}s in a detached loop (PID in LAB_DIR/run/fake-node-NAME.pid) so the
#          node-lifecycle controller never marks it NotReady/unreachable.
#   beat:  one status patch (what the loop does).
#   stop:  stop the heartbeat loop (the Node object stays; delete it with kubectl).
# down.sh also stops any heartbeat loops it finds in run/.
set -euo pipefail
cmd=${1:?usage: fake-node.sh start|stop|beat NAME [LAB_DIR]}
NAME=${2:?node name}
LAB=${3:?LAB_DIR (the directory given to control-plane.sh)}
LAB=$(cd "$LAB" && pwd)
KC=("${KUBECTL:-kubectl}" --kubeconfig "$LAB/kubeconfig" --request-timeout=10s)
PIDF=$LAB/run/fake-node-$NAME.pid
SELF=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/fake-node.sh

beat() {
  local now
  now=$(date -u +%Y-%m-%dT%H:%M:%SZ)
  "${KC[@]}" patch node "$NAME" --subresource=status --type=merge -p "{\"status\":{
    \"conditions\":[{\"type\":\"Ready\",\"status\":\"True\",\"reason\":\"KubeletReady\",\"message\":\"fake node heartbeat\",
                     \"lastHeartbeatTime\":\"$now\",\"lastTransitionTime\":\"$now\"}],
    \"capacity\":{\"cpu\":\"64\",\"memory\":\"512Gi\",\"pods\":\"110\"},
    \"allocatable\":{\"cpu\":\"64\",\"memory\":\"512Gi\",\"pods\":\"110\"}}}" >/dev/null
}

case "$cmd" in
  start)
    "${KC[@]}" apply -f - <<NODE
apiVersion: v1
kind: Node
metadata:
  name: $NAME
  labels:
    kubernetes.io/hostname: $NAME
    kubernetes.io/os: linux
    kubernetes.io/arch: amd64
NODE
    beat
    if [ -f "$PIDF" ] && kill -0 "$(cat "$PIDF")" 2>/dev/null; then
      echo "heartbeat already running: pid $(cat "$PIDF")"; exit 0
    fi
    setsid bash -c 'echo $$ > "$0"; exec "$1" loop "$2" "$3"' "$PIDF" "$SELF" "$NAME" "$LAB" \
      > "$LAB/logs/fake-node-$NAME.log" 2>&1 < /dev/null &
    sleep 0.5; echo "heartbeat for node $NAME: pid $(cat "$PIDF")"
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
