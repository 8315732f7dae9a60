#!/usr/bin/env bash
# control-plane.sh LAB_DIR   (tests/k8s_lab.py runs it once LAB_DIR/bin holds the binaries)
#
# Starts a small real Kubernetes v1.36 control plane on loopback (wc-test-k8s):
#   etcd (Debian etcd-server)  -> http://127.0.0.1:${ETCD_PORT:-2479}   (peer ${ETCD_PEER_PORT:-2480})
#   kube-apiserver             -> https://127.0.0.1:${APISERVER_PORT:-7443}
#   kube-controller-manager    -> https://127.0.0.1:${KCM_PORT:-10357}   (healthz/metrics only)
#   kube-scheduler             -> https://127.0.0.1:${SCHED_PORT:-10359} (healthz/metrics only)
# Idempotent: generates certs/keys/kubeconfigs only when missing, starts only components whose
# recorded process is not alive (etcd, then the apiserver; the controller-manager and scheduler
# only once the apiserver's /healthz is ok, so RBAC bootstrap roles exist), waits until
# the apiserver's /healthz (as the admin) says ok and the controller-manager's and scheduler's /healthz say
# ok, exits 0. Concurrent invocations are serialised with flock on LAB_DIR/run/up.lock.
# If everything is already up and healthy it just exits 0.
# Processes run detached (setsid + nohup); PIDs in LAB_DIR/run/*.pid, logs in LAB_DIR/logs.
#
# LAB_DIR defaults to the directory this script is in; it must contain bin/kube-apiserver,
# bin/kube-controller-manager and bin/kube-scheduler (k8s_lab.py links them there from
# $KUBEBUILDER_ASSETS). etcd and kubectl: $ETCD_BIN and $KUBECTL, else found on PATH.
# Dynamic Resource Allocation: resource.k8s.io/v1 is GA and on by default in 1.34+, so no
# feature gate / runtime-config is needed. FEATURE_GATES (e.g. "DRADeviceTaints=true") is passed
# to all three components when set; RUNTIME_CONFIG to the apiserver's --runtime-config.
# Extra flags: APISERVER_EXTRA_ARGS, KCM_EXTRA_ARGS, SCHED_EXTRA_ARGS, ETCD_EXTRA_ARGS (word-split).
set -euo pipefail

LAB=${1:-${LAB_DIR:-$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)}}
LAB=$(cd "$LAB" && pwd)
ETCD_PORT=${ETCD_PORT:-2479}
ETCD_PEER_PORT=${ETCD_PEER_PORT:-2480}
APISERVER_PORT=${APISERVER_PORT:-7443}
KCM_PORT=${KCM_PORT:-10357}
SCHED_PORT=${SCHED_PORT:-10359}
SERVICE_CIDR=${SERVICE_CIDR:-10.96.0.0/16}
SERVICE_IP=${SERVICE_IP:-10.96.0.1}
WAIT_S=${WAIT_S:-180}
FEATURE_GATES=${FEATURE_GATES:-}
RUNTIME_CONFIG=${RUNTIME_CONFIG:-}

BIN=$LAB/bin
PKI=$LAB/pki
RUN=$LAB/run
LOGS=$LAB/logs
DATA=$LAB/data
KUBECONFIG_ADMIN=$LAB/kubeconfig
ETCD_BIN=${ETCD_BIN:-$(command -v etcd || true)}
KUBECTL=${KUBECTL:-$(command -v kubectl || true)}

for b in "$BIN/kube-apiserver" "$BIN/kube-controller-manager" "$BIN/kube-scheduler"; do
  [ -x "$b" ] || { echo "control-plane.sh: $b missing" >&2; exit 1; }
done
[ -n "$ETCD_BIN" ] || { echo "control-plane.sh: etcd not found (apt-get install etcd-server)" >&2; exit 1; }
command -v openssl >/dev/null || { echo "control-plane.sh: openssl not found" >&2; exit 1; }

mkdir -p "$PKI" "$RUN" "$LOGS" "$DATA"
chmod 700 "$PKI" "$DATA"

log() { echo "[up $(date +%H:%M:%S)] $*"; }

exec 9> "$RUN/up.lock"
flock -w 600 9 || { echo "control-plane.sh: could not lock $RUN/up.lock" >&2; exit 1; }

# ---------------------------------------------------------------- helpers
# alive NAME: the pid in run/NAME.pid is alive and is ours (its cmdline mentions LAB)
alive() {
  local f=$RUN/$1.pid pid
  [ -f "$f" ] || return 1
  pid=$(cat "$f" 2>/dev/null) || return 1
  [[ "$pid" =~ ^[0-9]+$ ]] || return 1
  kill -0 "$pid" 2>/dev/null || return 1
  tr '\0' ' ' < "/proc/$pid/cmdline" 2>/dev/null | grep -qF -- "$LAB/" || return 1
}

# port_busy PORT: something listens on 127.0.0.1:PORT
port_busy() {
  (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null
}

# start NAME LOGFILE CMD...: start detached in its own session, record its PID
start() {
  local name=$1 logf=$2; shift 2
  rm -f "$RUN/$name.pid"
  echo "==== $(date -Is) starting $name" >> "$logf"
  # bash writes its own PID, then exec keeps that PID for the real program
  setsid bash -c 'echo $$ > "$0"; exec nohup "$@"' "$RUN/$name.pid" "$@" \
    >> "$logf" 2>&1 < /dev/null 9>&- &
  local i
  for i in $(seq 1 50); do [ -s "$RUN/$name.pid" ] && break; sleep 0.1; done
  log "started $name pid $(cat "$RUN/$name.pid" 2>/dev/null || echo ?)"
}

healthz() {  # the apiserver's /healthz as the admin (curl: a tenth of a kubectl start's CPU)
  curl -s --max-time 5 --cacert "$PKI/ca.crt" --cert "$PKI/admin.crt" --key "$PKI/admin.key" \
    "https://127.0.0.1:$APISERVER_PORT/healthz" 2>/dev/null
}

port_healthz() {  # port_healthz PORT
  curl -sk --max-time 3 "https://127.0.0.1:$1/healthz" 2>/dev/null
}

fg_args=()
[ -n "$FEATURE_GATES" ] && fg_args=(--feature-gates="$FEATURE_GATES")

# ---------------------------------------------------------------- fast path
if alive etcd && alive kube-apiserver && alive kube-controller-manager && alive kube-scheduler \
   && [ "$(healthz || true)" = ok ]; then
  log "already up and healthy (apiserver https://127.0.0.1:$APISERVER_PORT)"
  exit 0
fi

# ---------------------------------------------------------------- pki
gen_key() { [ -f "$1" ] || openssl genrsa -out "$1" 2048 2>/dev/null; chmod 600 "$1"; }

# sign_cert NAME SUBJ EXT(extension text)
sign_cert() {
  local name=$1 subj=$2 ext=$3
  [ -f "$PKI/$name.crt" ] && return 0
  gen_key "$PKI/$name.key"
  openssl req -new -key "$PKI/$name.key" -subj "$subj" -out "$PKI/$name.csr" 2>/dev/null
  printf '%s\n' "$ext" > "$PKI/$name.ext"
  openssl x509 -req -in "$PKI/$name.csr" -CA "$PKI/ca.crt" -CAkey "$PKI/ca.key" \
    -CAcreateserial -days 3650 -sha256 -extfile "$PKI/$name.ext" -out "$PKI/$name.crt" 2>/dev/null
  rm -f "$PKI/$name.csr" "$PKI/$name.ext"
  log "issued $name.crt ($subj)"
}

if [ ! -f "$PKI/ca.crt" ]; then
  gen_key "$PKI/ca.key"
  openssl req -x509 -new -key "$PKI/ca.key" -subj "/CN=wc-test-k8s-ca" -days 3650 -sha256 \
    -addext "basicConstraints=critical,CA:TRUE" \
    -addext "keyUsage=critical,digitalSignature,keyEncipherment,keyCertSign" \
    -out "$PKI/ca.crt" 2>/dev/null
  log "created CA"
fi
CLIENT_EXT='basicConstraints=critical,CA:FALSE
keyUsage=critical,digitalSignature,keyEncipherment
extendedKeyUsage=clientAuth'
sign_cert apiserver "/CN=kube-apiserver" "basicConstraints=critical,CA:FALSE
keyUsage=critical,digitalSignature,keyEncipherment
extendedKeyUsage=serverAuth
subjectAltName=DNS:localhost,DNS:kubernetes,DNS:kubernetes.default,DNS:kubernetes.default.svc,DNS:kubernetes.default.svc.cluster.local,IP:127.0.0.1,IP:$SERVICE_IP"
sign_cert admin "/O=system:masters/CN=admin" "$CLIENT_EXT"
sign_cert controller-manager "/CN=system:kube-controller-manager" "$CLIENT_EXT"
sign_cert scheduler "/CN=system:kube-scheduler" "$CLIENT_EXT"
sign_cert apiserver-kubelet-client "/O=system:masters/CN=kube-apiserver-kubelet-client" "$CLIENT_EXT"
# separate CA for the aggregation layer's front proxy (requestheader auth)
if [ ! -f "$PKI/front-proxy-ca.crt" ]; then
  gen_key "$PKI/front-proxy-ca.key"
  openssl req -x509 -new -key "$PKI/front-proxy-ca.key" -subj "/CN=wc-test-k8s-front-proxy-ca" -days 3650 -sha256 \
    -addext "basicConstraints=critical,CA:TRUE" \
    -addext "keyUsage=critical,digitalSignature,keyEncipherment,keyCertSign" \
    -out "$PKI/front-proxy-ca.crt" 2>/dev/null
  log "created front-proxy CA"
fi
if [ ! -f "$PKI/front-proxy-client.crt" ]; then
  gen_key "$PKI/front-proxy-client.key"
  openssl req -new -key "$PKI/front-proxy-client.key" -subj "/CN=front-proxy-client" -out "$PKI/front-proxy-client.csr" 2>/dev/null
  printf '%s\n' "$CLIENT_EXT" > "$PKI/front-proxy-client.ext"
  openssl x509 -req -in "$PKI/front-proxy-client.csr" -CA "$PKI/front-proxy-ca.crt" -CAkey "$PKI/front-proxy-ca.key" \
    -CAcreateserial -days 3650 -sha256 -extfile "$PKI/front-proxy-client.ext" -out "$PKI/front-proxy-client.crt" 2>/dev/null
  rm -f "$PKI/front-proxy-client.csr" "$PKI/front-proxy-client.ext"
  log "issued front-proxy-client.crt"
fi
if [ ! -f "$PKI/sa.key" ]; then
  gen_key "$PKI/sa.key"
  openssl rsa -in "$PKI/sa.key" -pubout -out "$PKI/sa.pub" 2>/dev/null
  log "created service-account signing key"
fi

# write_kubeconfig FILE USER CERTNAME
write_kubeconfig() {
  local f=$1 user=$2 cert=$3
  [ -f "$f" ] && grep -q "server: https://127.0.0.1:$APISERVER_PORT\$" "$f" && return 0
  umask 077
  cat > "$f" <<KCFG
apiVersion: v1
kind: Config
clusters:
- name: wc-test-k8s
  cluster:
    server: https://127.0.0.1:$APISERVER_PORT
    certificate-authority-data: $(base64 -w0 < "$PKI/ca.crt")
users:
- name: $user
  user:
    client-certificate-data: $(base64 -w0 < "$PKI/$cert.crt")
    client-key-data: $(base64 -w0 < "$PKI/$cert.key")
contexts:
- name: $user@wc-test-k8s
  context:
    cluster: wc-test-k8s
    user: $user
current-context: $user@wc-test-k8s
KCFG
  umask 022
  log "wrote $f"
}
write_kubeconfig "$KUBECONFIG_ADMIN" admin admin
write_kubeconfig "$PKI/controller-manager.kubeconfig" system:kube-controller-manager controller-manager
write_kubeconfig "$PKI/scheduler.kubeconfig" system:kube-scheduler scheduler

# ---------------------------------------------------------------- etcd
if ! alive etcd; then
  if port_busy "$ETCD_PORT" || port_busy "$ETCD_PEER_PORT"; then
    echo "control-plane.sh: port $ETCD_PORT or $ETCD_PEER_PORT is in use by a process this script did not start" >&2
    exit 1
  fi
  mkdir -p "$DATA/etcd"; chmod 700 "$DATA/etcd"
  # shellcheck disable=SC2086
  start etcd "$LOGS/etcd.log" "$ETCD_BIN" \
    --name wc-test-k8s \
    --data-dir "$DATA/etcd" \
    --listen-client-urls "http://127.0.0.1:$ETCD_PORT" \
    --advertise-client-urls "http://127.0.0.1:$ETCD_PORT" \
    --listen-peer-urls "http://127.0.0.1:$ETCD_PEER_PORT" \
    --initial-advertise-peer-urls "http://127.0.0.1:$ETCD_PEER_PORT" \
    --initial-cluster "wc-test-k8s=http://127.0.0.1:$ETCD_PEER_PORT" \
    --initial-cluster-state new \
    --snapshot-count 10000 \
    --quota-backend-bytes 4294967296 \
    ${ETCD_EXTRA_ARGS:-}
fi
for i in $(seq 1 "$WAIT_S"); do
  if [ "$(curl -s --max-time 2 "http://127.0.0.1:$ETCD_PORT/health" 2>/dev/null | tr -d ' ' | sed 's/,"reason":""//')" = '{"health":"true"}' ]; then
    break
  fi
  alive etcd || { echo "control-plane.sh: etcd exited; see $LOGS/etcd.log" >&2; tail -20 "$LOGS/etcd.log" >&2; exit 1; }
  [ "$i" = "$WAIT_S" ] && { echo "control-plane.sh: etcd not healthy after ${WAIT_S}s" >&2; exit 1; }
  sleep 1
done
log "etcd healthy on 127.0.0.1:$ETCD_PORT"

# ---------------------------------------------------------------- kube-apiserver
if ! alive kube-apiserver; then
  if port_busy "$APISERVER_PORT"; then
    echo "control-plane.sh: port $APISERVER_PORT is in use by a process this script did not start" >&2
    exit 1
  fi
  rc_args=()
  [ -n "$RUNTIME_CONFIG" ] && rc_args=(--runtime-config="$RUNTIME_CONFIG")
  # shellcheck disable=SC2086
  start kube-apiserver "$LOGS/kube-apiserver.log" "$BIN/kube-apiserver" \
    --bind-address=127.0.0.1 \
    --advertise-address=127.0.0.1 \
    --secure-port="$APISERVER_PORT" \
    --etcd-servers="http://127.0.0.1:$ETCD_PORT" \
    --tls-cert-file="$PKI/apiserver.crt" \
    --tls-private-key-file="$PKI/apiserver.key" \
    --client-ca-file="$PKI/ca.crt" \
    --kubelet-client-certificate="$PKI/apiserver-kubelet-client.crt" \
    --kubelet-client-key="$PKI/apiserver-kubelet-client.key" \
    --service-account-issuer=https://kubernetes.default.svc.cluster.local \
    --service-account-key-file="$PKI/sa.pub" \
    --service-account-signing-key-file="$PKI/sa.key" \
    --service-cluster-ip-range="$SERVICE_CIDR" \
    --requestheader-client-ca-file="$PKI/front-proxy-ca.crt" \
    --requestheader-allowed-names=front-proxy-client \
    --requestheader-username-headers=X-Remote-User \
    --requestheader-group-headers=X-Remote-Group \
    --requestheader-extra-headers-prefix=X-Remote-Extra- \
    --proxy-client-cert-file="$PKI/front-proxy-client.crt" \
    --proxy-client-key-file="$PKI/front-proxy-client.key" \
    --authorization-mode=Node,RBAC \
    --allow-privileged=true \
    --endpoint-reconciler-type=none \
    --profiling=false \
    --v=1 \
    "${fg_args[@]}" "${rc_args[@]}" \
    ${APISERVER_EXTRA_ARGS:-}
fi

# ---------------------------------------------------------------- wait for the apiserver
for i in $(seq 1 "$WAIT_S"); do
  if [ "$(healthz || true)" = ok ]; then
    break
  fi
  alive kube-apiserver || { echo "control-plane.sh: kube-apiserver exited; see $LOGS/kube-apiserver.log" >&2; tail -20 "$LOGS/kube-apiserver.log" >&2; exit 1; }
  [ "$i" = "$WAIT_S" ] && { echo "control-plane.sh: apiserver not healthy after ${WAIT_S}s" >&2; exit 1; }
  sleep 1
done
log "apiserver healthy on https://127.0.0.1:$APISERVER_PORT"

# ---------------------------------------------------------------- kube-controller-manager
if ! alive kube-controller-manager; then
  if port_busy "$KCM_PORT"; then
    echo "control-plane.sh: port $KCM_PORT is in use by a process this script did not start" >&2
    exit 1
  fi
  # shellcheck disable=SC2086
  start kube-controller-manager "$LOGS/kube-controller-manager.log" "$BIN/kube-controller-manager" \
    --kubeconfig="$PKI/controller-manager.kubeconfig" \
    --authentication-kubeconfig="$PKI/controller-manager.kubeconfig" \
    --authorization-kubeconfig="$PKI/controller-manager.kubeconfig" \
    --client-ca-file="$PKI/ca.crt" \
    --requestheader-client-ca-file="$PKI/front-proxy-ca.crt" \
    --bind-address=127.0.0.1 \
    --secure-port="$KCM_PORT" \
    --controllers='*' \
    --use-service-account-credentials=true \
    --service-account-private-key-file="$PKI/sa.key" \
    --root-ca-file="$PKI/ca.crt" \
    --cluster-signing-cert-file="$PKI/ca.crt" \
    --cluster-signing-key-file="$PKI/ca.key" \
    --service-cluster-ip-range="$SERVICE_CIDR" \
    --cluster-name=wc-test-k8s \
    --leader-elect=false \
    --profiling=false \
    --v=1 \
    "${fg_args[@]}" \
    ${KCM_EXTRA_ARGS:-}
fi

# ---------------------------------------------------------------- kube-scheduler
if ! alive kube-scheduler; then
  if port_busy "$SCHED_PORT"; then
    echo "control-plane.sh: port $SCHED_PORT is in use by a process this script did not start" >&2
    exit 1
  fi
  # shellcheck disable=SC2086
  start kube-scheduler "$LOGS/kube-scheduler.log" "$BIN/kube-scheduler" \
    --kubeconfig="$PKI/scheduler.kubeconfig" \
    --authentication-kubeconfig="$PKI/scheduler.kubeconfig" \
    --authorization-kubeconfig="$PKI/scheduler.kubeconfig" \
    --client-ca-file="$PKI/ca.crt" \
    --requestheader-client-ca-file="$PKI/front-proxy-ca.crt" \
    --bind-address=127.0.0.1 \
    --secure-port="$SCHED_PORT" \
    --leader-elect=false \
    --profiling=false \
    --v=1 \
    "${fg_args[@]}" \
    ${SCHED_EXTRA_ARGS:-}
fi

for i in $(seq 1 "$WAIT_S"); do
  k=$(port_healthz "$KCM_PORT" || true); s=$(port_healthz "$SCHED_PORT" || true)
  [ "$k" = ok ] && [ "$s" = ok ] && break
  alive kube-controller-manager || { echo "control-plane.sh: kube-controller-manager exited; see $LOGS/kube-controller-manager.log" >&2; tail -20 "$LOGS/kube-controller-manager.log" >&2; exit 1; }
  alive kube-scheduler || { echo "control-plane.sh: kube-scheduler exited; see $LOGS/kube-scheduler.log" >&2; tail -20 "$LOGS/kube-scheduler.log" >&2; exit 1; }
  [ "$i" = "$WAIT_S" ] && { echo "control-plane.sh: controller-manager/scheduler not healthy after ${WAIT_S}s (kcm: $k, scheduler: $s)" >&2; exit 1; }
  sleep 1
done
[ "$(healthz || true)" = ok ] || { echo "control-plane.sh: apiserver /healthz not ok" >&2; exit 1; }
log "healthy: https://127.0.0.1:$APISERVER_PORT  (export KUBECONFIG=$KUBECONFIG_ADMIN)"
exit 0
