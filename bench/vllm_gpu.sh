#!/usr/bin/env bash
# vLLM 0.24.0 (CUDA 13, torch 2.11.0) onto a GPU machine that has no network, then bench/vllm_gpu.py there.
#
#   bench/vllm_gpu.sh pack                here: vLLM's wheel and what it needs beside the GPU image
#                                         (bench/vllm_gpu_requirements.txt), installed into one tree for
#                                         Python 3.12, packed as .vllm-gpu/vllm-site.tar.xz.part-NN (< 60 MiB)
#   bench/vllm_gpu.sh receive             there, once per part (each call carries one part): keeps it
#                                         outside the checkout, where the next call finds it
#   bench/vllm_gpu.sh run [ARGS]          there: joins and unpacks the parts, installs this checkout
#                                         beside vLLM (its plugin entry point), runs bench/vllm_gpu.py ARGS
#   bench/vllm_gpu.sh start [ARGS]        there: the same in the background (setsid), log in $PARTS/run.log
#                                         ($WEIGHTCACHE_BENCH names another script: bench/vllm_startup.py);
#   bench/vllm_gpu.sh wait [SECONDS]      then wait for it (at most SECONDS), copying its tables to $OUT
#   bench/vllm_gpu.sh profile [ARGS]      there: bench/vllm_load_profile.py ARGS (where model loading's time goes)
set -euo pipefail
cd "$(dirname "$0")/.."
PACK=.vllm-gpu
PARTS=${WEIGHTCACHE_VLLM_PARTS:-/root/vllm-gpu-parts}
SITE=${WEIGHTCACHE_VLLM_SITE:-/tmp/vllm-site}
OUT=${OUT:-/tmp/wc-out}
BENCH=${WEIGHTCACHE_BENCH:-bench/vllm_gpu.py}

pack() {
  local tmp; tmp=$(mktemp -d)
  local platform=(--only-binary=:all: --python-version 3.12 --implementation cp --abi cp312 --abi abi3 --abi none
                  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64
                  --platform manylinux2014_x86_64 --platform manylinux_2_31_x86_64 --platform any)
  python3 -m pip download -q --no-deps "${platform[@]}" -d "$tmp/wheels" vllm==0.24.0 \
    -r bench/vllm_gpu_requirements.txt
  python3 -m pip install -q --no-deps --no-compile "${platform[@]}" --target "$tmp/site" "$tmp"/wheels/*.whl
  # FlashAttention-2 (an H200 runs FlashAttention-3), Blackwell's attention kernels, other Pythons' builds
  rm -rf "$tmp/site/vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so" "$tmp/site/vllm/third_party/fmha_sm100" \
         "$tmp"/site/vllm/third_party/deep_gemm/_C.cpython-3{10,11,13,14}-*.so
  mkdir -p "$PACK" && rm -f "$PACK"/vllm-site.tar.xz.part-*
  tar -C "$tmp/site" -cf - . | xz -T0 -6 | split -b 55M -d - "$PACK/vllm-site.tar.xz.part-"
  rm -rf "$tmp"
  ls -l "$PACK"
  echo "send each part in back-to-back device calls (carry: [\"$PACK/vllm-site.tar.xz.part-NN\"], command:" \
       "bench/vllm_gpu.sh receive); then bench/vllm_gpu.sh run (or start + wait) with the last part"
}

receive() {
  mkdir -p "$PARTS"
  cp -v "$PACK"/vllm-site.tar.xz.part-* "$PARTS"/
  ls -l "$PARTS"
}

install() {
  receive 2>/dev/null || true
  if [ ! -e "$SITE/vllm/__init__.py" ]; then
    mkdir -p "$SITE"
    cat "$PARTS"/vllm-site.tar.xz.part-* | xz -dc -T0 | tar -C "$SITE" -xf -
  fi
  # the checkout's code first: the copy installed below only gives vLLM the plugin's entry point
  export PYTHONPATH="$PWD/node_agent:$PWD/operator:$SITE" PYTHONUNBUFFERED=1
  # FlashInfer is left out (bench/vllm_gpu_requirements.txt): vLLM's sampler then uses its PyTorch path
  export VLLM_USE_FLASHINFER_SAMPLER=0
  # this checkout as an installed distribution, so that vLLM's processes find its plugin entry point
  if ! python3 -c "import importlib.metadata as m; m.distribution('weightcache')" 2>/dev/null; then
    python3 -m pip install -q --no-deps --no-build-isolation --no-index --target "$SITE" . > "$OUT/install.log" 2>&1 \
      || { echo "pip install of the checkout failed (install.log)"; exit 1; }
  fi
  python3 -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)"
}

case "${1:-}" in
  pack) pack ;;
  receive) receive ;;
  run) mkdir -p "$OUT"; install; shift; python3 bench/vllm_gpu.py --out "$OUT" --dir /tmp/wc-vllm-gpu "$@" ;;
  profile) mkdir -p "$OUT"; install; shift; python3 bench/vllm_load_profile.py --out "$OUT" "$@" ;;
  start)
    mkdir -p "$OUT"; install; shift
    rm -rf "$PARTS/out"
    setsid nohup python3 "$BENCH" --out "$PARTS/out" --dir /tmp/wc-vllm-gpu "$@" > "$PARTS/run.log" 2>&1 &
    echo "started: $PARTS/run.log" ;;
  wait)
    deadline=$(( $(date +%s) + ${2:-540} ))
    while pgrep -f "$BENCH" >/dev/null && [ "$(date +%s)" -lt "$deadline" ]; do sleep 5; done
    mkdir -p "$OUT"; cp "$PARTS"/run.log "$PARTS"/out/* "$OUT"/ 2>/dev/null || true
    (cd /tmp/wc-vllm-gpu && tar -czf "$OUT/logs.tgz" -- *.log) 2>/dev/null || true
    tail -40 "$PARTS/run.log"
    pgrep -f "$BENCH" >/dev/null && echo "still running" || echo "finished" ;;
  *) sed -n 2,14p "$0"; exit 2 ;;
esac
