#!/usr/bin/env bash
# Build the weightcache images with buildah (no Docker daemon needed) and write each as an OCI
# archive, ready for `skopeo copy oci-archive:dist/images/agent.tar docker://REGISTRY/...` or `podman load`.
#
#   images/build.sh [--debian-base [--cpu-torch VERSION]] [--out DIR] [--storage DIR] [--compression-level N] [IMAGE...]
#
# IMAGE: agent, operator (the default: both), vllm (on vLLM's image only: not with --debian-base). Each is tagged localhost/weightcache-IMAGE:VERSION
# (VERSION from pyproject.toml) and written to DIR/IMAGE.tar (--out DIR; dist/images/ by default).
#   --debian-base      build on a Debian bookworm made here with mmdebstrap (python3 and its venv
#                      module), one base for every image, instead of each Dockerfile's public BASE:
#                      no image registry needed
#   --cpu-torch VER    give the agent the CPU build of torch VER (e.g. 2.13.0) for the Debian base's
#                      Python, fetched by this machine's pip (its dependencies from PyPI), instead of
#                      the Dockerfile's CUDA build: a test image, for engines on the cpu backend
#   --storage DIR      buildah's storage (images, containers) in DIR instead of its default place
#   --compression-level N  the gzip level of the archives' layers, 1 (fastest) to 9 (smallest), instead
#                      of buildah's default: at 1 they are some 15% larger and take 30% less CPU time
#                      to write, for archives read only on the machine that built them (CI)
# Layers are cached in the storage, as docker build caches them: a step runs again only where it or
# what comes before it changed (a COPY's files included). The Debian base made by --debian-base is
# reused while it is less than BASE_MAX_AGE_DAYS old (7 by default; 0 makes a new one), so the
# layers on it, apt's and pip's downloads included, are at most that old.
# Needs buildah (and mmdebstrap for --debian-base); runs every step with --isolation chroot, so it
# needs no container runtime. CONTAINERS_CONF, if unset, names a file written here that sets no
# default ulimits (a sandbox that cannot raise them refuses a build that asks).
set -euo pipefail
root=$(realpath "$(dirname "$0")/..")

out=$root/dist/images debian=0 cpu_torch="" storage=() compression=() images=()
while [ $# -gt 0 ]; do
  case $1 in
    --debian-base) debian=1 ;;
    --cpu-torch) cpu_torch=$2; shift ;;
    --out) out=$(realpath -m "$2"); shift ;;
    --storage) storage=(--root "$(realpath -m "$2")/root" --runroot "$(realpath -m "$2")/run"); shift ;;
    --compression-level)
      [[ ${2:-} =~ ^[1-9]$ ]] || { echo "images/build.sh: --compression-level takes a gzip level from 1 to 9, not '${2:-}'" >&2; exit 2; }
      compression=(--compression-format gzip --compression-level "$2"); shift ;;
    agent|operator|vllm) images+=("$1") ;;
    -h|--help) sed -n '2,/^set -e/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    *) echo "images/build.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
  shift
done
[ ${#images[@]} -gt 0 ] || images=(agent operator)
if [ -n "$cpu_torch" ] && [ "$debian" = 0 ]; then
  echo "images/build.sh: --cpu-torch needs --debian-base (its wheel is for that base's Python 3.11)" >&2; exit 2
fi
for image in "${images[@]}"; do
  if [ "$image" = vllm ] && [ "$debian" = 1 ]; then
    echo "images/build.sh: the vllm image builds on vLLM's own image (its Dockerfile's BASE), not on --debian-base; build it without --debian-base" >&2; exit 2
  fi
done
cd "$root"
version=$(sed -n 's/^version = "\(.*\)"/\1/p' pyproject.toml)
work=$(mktemp -d "${TMPDIR:-/tmp}/weightcache-images.XXXXXX")
trap 'rm -rf "$work"' EXIT
if [ -z "${CONTAINERS_CONF:-}" ]; then
  printf '[containers]\ndefault_ulimits = []\n' > "$work/containers.conf"
  export CONTAINERS_CONF=$work/containers.conf
fi
buildah() { command buildah "${storage[@]}" "$@"; }
mkdir -p "$out"
# Files a build step reads from this machine sit in a folder mounted on the step's /tmp, so that
# nothing of them (nor a mount point) stays in the image.
share=$work/share
mkdir -m 1777 "$share"
args=(--volume "$share:/tmp")
torch=()
if [ -n "$cpu_torch" ]; then
  # Not retried: where PyTorch's CPU index cannot be reached, pip's own places (find-links) may hold the wheel.
  python3 -m pip download --quiet --no-deps --only-binary :all: --python-version 3.11 \
    --platform manylinux_2_28_x86_64 --retries 0 --extra-index-url https://download.pytorch.org/whl/cpu \
    -d "$share" "torch==$cpu_torch+cpu"
  wheel=$(ls "$share"/torch-*.whl)
  torch=(--build-arg "TORCH=/tmp/${wheel##*/}" --build-arg TORCH_INDEX=https://pypi.org/simple)
fi
# Behind a TLS-intercepting proxy pip needs this machine's certificate authorities: the bundle pip
# uses here (PIP_CERT, else pip's `cert` setting) goes to the build steps' pip as PIP_CERT.
cert=${PIP_CERT:-$(python3 -m pip config get global.cert 2>/dev/null || true)}
if [ -n "$cert" ] && [ -f "$cert" ]; then
  cp "$cert" "$share/ca.crt"
  args+=(--build-arg PIP_CERT=/tmp/ca.crt)
fi
if [ "$debian" = 1 ]; then
  began=$SECONDS
  base=localhost/weightcache-base:bookworm
  made=$(buildah inspect --type image --format '{{.Docker.Created.Unix}}' "$base" 2>/dev/null || echo 0)
  if [ $(( $(date +%s) - made )) -lt $(( ${BASE_MAX_AGE_DAYS:-7} * 86400 )) ]; then
    echo "images/build.sh: Debian base $base reused, made $(( ($(date +%s) - made) / 3600 )) h ago"
  else
    mmdebstrap --quiet --variant=minbase --include=python3,python3-venv bookworm "$work/debian.tar"
    ctr=$(buildah from scratch)
    buildah add --quiet "$ctr" "$work/debian.tar" /
    rm "$work/debian.tar"
    buildah config --env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin --cmd /bin/bash "$ctr"
    buildah commit --quiet --rm "$ctr" "$base" >/dev/null
    echo "images/build.sh: Debian base $base in $((SECONDS - began)) s"
  fi
  args+=(--build-arg "BASE=$base")
fi
for image in "${images[@]}"; do
  began=$SECONDS
  extra=()
  [ "$image" != agent ] || extra=("${torch[@]}")
  tag=localhost/weightcache-$image:$version
  # A Dockerfile's `build` stage (the agent's compilers, and what they compiled) gets a name of its
  # own: no step of the image follows its last one, so unnamed it would be pruned (`buildah rmi
  # --prune`), and with it every layer of the stage, the compilers' and the row binder's.
  if grep -q '^FROM .* AS build$' "images/$image.Dockerfile"; then
    buildah bud --layers --isolation chroot "${args[@]}" "${extra[@]}" -f "images/$image.Dockerfile" \
      --target build -t "localhost/weightcache-$image-build:$version" .
  fi
  buildah bud --layers --isolation chroot "${args[@]}" "${extra[@]}" -f "images/$image.Dockerfile" -t "$tag" .
  rm -f "$out/$image.tar"
  buildah push --quiet "${compression[@]}" "$tag" "oci-archive:$out/$image.tar:weightcache-$image:$version"
  echo "images/build.sh: $tag -> $out/$image.tar in $((SECONDS - began)) s"
done
