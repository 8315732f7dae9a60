#!/usr/bin/env bash
# SGLang 0.5.17 (torch 2.11.0, CUDA 13) onto a GPU machine that has no network, then bench/sglang_gpu.py there.
#
#   bench/sglang_gpu.sh pack              here: SGLang's wheel and what it needs beside the GPU image
#                                         (bench/sglang_gpu_requirements.txt), installed into one tree for
#                                         Python 3.12, packed as .sglang-gpu/sglang-site.tar.xz.part-NN (< 55 MiB)
#   bench/sglang_gpu.sh receive           there, once per part (each call carries one part): keeps it
#                                         outside the checkout, where the next call finds it
#   bench/sglang_gpu.sh check             there: unpacks, installs, imports SGLang's server path, prints versions
#   bench/sglang_gpu.sh run [ARGS]        there: joins and unpacks the parts, installs this checkout
#                                         beside SGLang (its plugin entry point), runs bench/sglang_gpu.py ARGS
#   bench/sglang_gpu.sh start [ARGS]      there: the same in the background (setsid), log in $PARTS/run.log;
#   bench/sglang_gpu.sh wait [SECONDS]    then wait for it (at most SECONDS), copying its tables to $OUT
set -euo pipefail
cd "$(dirname "$0")/.."
PACK=.sglang-gpu
PARTS=${WEIGHTCACHE_SGLANG_PARTS:-/root/sglang-gpu-parts}
SITE=${WEIGHTCACHE_SGLANG_SITE:-/tmp/sglang-site}
OUT=${OUT:-/tmp/wc-out}
WORK=/tmp/wc-sglang-gpu

pack() {
  local tmp; tmp=$(mktemp -d)
  local platform=(--only-binary=:all: --python-version 3.12 --implementation cp --abi cp312 --abi abi3 --abi none
                  --platform manylinux_2_34_x86_64 --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64
                  --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64
                  --platform any)
  python3 -m pip download -q --no-deps "${platform[@]}" -d "$tmp/wheels" sglang==0.5.17 \
    -r bench/sglang_gpu_requirements.txt
  python3 -m pip install -q --no-deps --no-compile "${platform[@]}" --target "$tmp/site" "$tmp"/wheels/*.whl
  # other Pythons' builds and Blackwell-only kernels, where a wheel carries them
  find "$tmp/site" -name '*.cpython-3*-*.so' ! -name '*.cpython-312-*' -delete
  mkdir -p "$PACK" && rm -f "$PACK"/sglang-site.tar.xz.part-*
  tar -C "$tmp/site" -cf - . | xz -T0 -6 | split -b 55M -d - "$PACK/sglang-site.tar.xz.part-"
  du -sh "$tmp/wheels" "$tmp/site"
  rm -rf "$tmp"
  ls -l "$PACK"
  echo "send each part in back-to-back device calls (carry: [\"$PACK/sglang-site.tar.xz.part-NN\"], command:" \
       "bench/sglang_gpu.sh receive); then bench/sglang_gpu.sh run (or start + wait) with the last part"
}

receive() {
  mkdir -p "$PARTS"
  cp -v "$PACK"/sglang-site.tar.xz.part-* "$PARTS"/
  ls -l "$PARTS"
}

install() {
  receive 2>/dev/null || true
  if [ ! -e "$SITE/sglang/__init__.py" ]; then
    mkdir -p "$SITE"
    cat "$PARTS"/sglang-site.tar.xz.part-* | xz -dc -T0 | tar -C "$SITE" -xf -
  fi
  # the checkout's code first: the copy installed below only gives SGLang the plugin's entry point
  export PYTHONPATH="$PWD/node_agent:$PWD/operator:$SITE" PYTHONUNBUFFERED=1
  # this checkout as an installed distribution, so that SGLang's processes find its plugin entry point
  if ! python3 -c "import importlib.metadata as m; m.distribution('weightcache')" 2>/dev/null; then
    mkdir -p "$OUT"
    python3 -m pip install -q --no-deps --no-build-isolation --no-index --target "$SITE" . > "$OUT/install.log" 2>&1 \
      || { echo "pip install of the checkout failed (install.log)"; exit 1; }
  fi
  # the bench's clock on SGLang's default loader (bench/sglang_load_timing.py), as a plugin of SGLang's
  cp bench/sglang_load_timing.py "$SITE/"
  mkdir -p "$SITE/weightcache_bench_timing-0.dist-info"
  printf 'Metadata-Version: 2.1\nName: weightcache-bench-timing\nVersion: 0\n' \
    > "$SITE/weightcache_bench_timing-0.dist-info/METADATA"
  printf '[sglang.srt.plugins]\nbench_timing = sglang_load_timing:register\n' \
    > "$SITE/weightcache_bench_timing-0.dist-info/entry_points.txt"
  python3 -c "import sglang, torch; print('sglang', sglang.__version__, 'torch', torch.__version__)"
  # the mixed phase's vLLM: its parts, where bench/vllm_gpu.sh receive left them, unpacked as that script does
  local vparts=${WEIGHTCACHE_VLLM_PARTS:-/root/vllm-gpu-parts} vsite=${WEIGHTCACHE_VLLM_SITE:-/tmp/vllm-site}
  if ls "$vparts"/vllm-site.tar.xz.part-* >/dev/null 2>&1 && [ ! -e "$vsite/vllm/__init__.py" ]; then
    mkdir -p "$vsite" && cat "$vparts"/vllm-site.tar.xz.part-* | xz -dc -T0 | tar -C "$vsite" -xf -
  fi
}

check() {
  python3 - <<'EOF'
import importlib, importlib.metadata as m
for mod in ("sglang.launch_server", "sglang.srt.entrypoints.http_server", "sglang.srt.managers.scheduler",
            "sglang.srt.model_executor.model_runner", "sglang.srt.models.llama",
            "sglang.srt.layers.attention.flashattention_backend", "sglang.srt.configs.model_config",
            "sglang.srt.layers.quantization", "sglang.srt.model_loader.loader", "sgl_kernel", "torch_memory_saver"):
    importlib.import_module(mod)
    print("imports", mod)
print("plugins:", [(e.name, e.value) for e in m.entry_points(group="sglang.srt.plugins")])
EOF
}

case "${1:-}" in
  pack) pack ;;
  receive) receive ;;
  check) mkdir -p "$OUT"; install; check ;;
  run) mkdir -p "$OUT"; install; shift; python3 bench/sglang_gpu.py --out "$OUT" --dir "$WORK" "$@" ;;
  start)
    mkdir -p "$OUT"; install; shift
    setsid nohup python3 bench/sglang_gpu.py --out "$PARTS/out" --dir "$WORK" "$@" > "$PARTS/run.log" 2>&1 &
    echo "started: $PARTS/run.log" ;;
  wait)
    deadline=$(( $(date +%s) + ${2:-540} ))
    while pgrep -f bench/sglang_gpu.py >/dev/null && [ "$(date +%s)" -lt "$deadline" ]; do sleep 5; done
    mkdir -p "$OUT"; cp "$PARTS"/run.log "$PARTS"/out/* "$OUT"/ 2>/dev/null || true
    (cd "$WORK" && tar -czf "$OUT/logs.tgz" -- *.log) 2>/dev/null || true
    tail -40 "$PARTS/run.log"
    pgrep -f bench/sglang_gpu.py >/dev/null && echo "still running" || echo "finished" ;;
  *) sed -n 2,15p "$0"; exit 2 ;;
esac
