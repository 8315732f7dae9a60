#!/usr/bin/env bash
# Everything that needs a GPU, in one device call: the CUDA tests, then the GPU benchmark.
# Usage on the device machine: bash bench/gpu_suite.sh [GIB]   (tables and logs land in $OUT)
#                              bash bench/gpu_suite.sh tests   (the CUDA tests only)
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD/node_agent:$PWD/operator${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
OUT="${OUT:-/tmp/wc-out}"; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,uuid,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, cuda.bindings; print('torch', torch.__version__, 'cuda', torch.version.cuda)" | tee -a "$OUT/gpu.txt"
# The attach loop's C extension (setup.py): the machine's python3 has no pip install of ours.
python3 setup.py -q build_ext --inplace > "$OUT/build_ext.log" 2>&1 || echo "C extension not built (see build_ext.log)"
# The torch-native row binder, compiled against this machine's torch (as an engine image would).
python3 -m weightcache_agent.cli build-native > "$OUT/build_native.log" 2>&1 || echo "row binder not built (see build_native.log)"
python3 -c "import setuptools; from weightcache_agent.client.rebind import _bindfast, _torch_rows; from weightcache_agent.load.fp8 import _fp8cpu; print('setuptools', setuptools.__version__, '| C bind:', 'built' if _bindfast else 'NOT built', '| C quantizer:', 'built' if _fp8cpu else 'NOT built', '| row binder:', 'built' if _torch_rows else 'NOT built')" | tee -a "$OUT/gpu.txt"
python3 bench/attach_profile.py cuda > "$OUT/attach_profile.log" 2>&1; head -2 "$OUT/attach_profile.log"
python3 -m pytest -q -p no:cacheprovider -o addopts="" tests/test_cuda_backend.py tests/test_prepare.py tests/test_transformers.py \
  tests/test_tp_cuda.py tests/test_bind_manifest.py tests/test_packed_rows.py tests/test_native_build.py tests/test_one_arena.py \
  tests/test_readonly_weights.py tests/test_security_digest_cuda.py tests/test_first_day.py 2>&1 | tee "$OUT/gpu_tests.log"
tests=${PIPESTATUS[0]}
[ "${1:-}" = tests ] && { echo "tests exit $tests"; exit "$tests"; }
python3 bench/gpu_bench.py --gib "${1:-32}" --out "$OUT" "${@:2}" 2>&1 | tee "$OUT/gpu_bench.log"
bench=${PIPESTATUS[0]}
# The user-visible figures: fresh processes, from outside (same checkpoint as the benchmark above).
python3 bench/fresh_process.py cuda --model "/tmp/wc-gpu-bench/llama-${1:-32}g" --out "$OUT" 2>&1 | tee "$OUT/fresh_process.log"
echo "tests exit $tests, bench exit $bench"
exit $(( tests || bench ))
