#!/usr/bin/env bash
# Everything that needs a GPU, in one device call: the CUDA tests, then the GPU benchmark.
# Usage on the device machine: bash bench/gpu_suite.sh [GIB]   (tables and logs land in $OUT)
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD/node_agent:$PWD/operator${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
OUT="${OUT:-/tmp/wc-out}"; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,uuid,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, cuda.bindings; print('torch', torch.__version__, 'cuda', torch.version.cuda)" | tee -a "$OUT/gpu.txt"
python3 -m pytest -q -p no:cacheprovider tests/test_cuda_backend.py 2>&1 | tee "$OUT/gpu_tests.log"
tests=${PIPESTATUS[0]}
python3 bench/gpu_bench.py --gib "${1:-32}" --out "$OUT" "${@:2}" 2>&1 | tee "$OUT/gpu_bench.log"
bench=${PIPESTATUS[0]}
echo "tests exit $tests, bench exit $bench"
exit $(( tests || bench ))
