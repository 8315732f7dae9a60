#!/usr/bin/env bash
# Tensor parallelism on one node of two GPUs, in one device call: the tests, then the benchmark.
# Usage on the device machine: bash bench/tp_suite.sh [GIB] [tp_bench.py flags]   (tables and logs in $OUT)
set -uo pipefail
cd "$(dirname "$0")/.."
# NVLink multicast stays off everywhere (NCCL, PyTorch, NVSHMEM): it can take shared GPUs out of service.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD/node_agent:$PWD/operator:$PWD/tests${PYTHONPATH:+:$PYTHONPATH}"
OUT="${OUT:-/tmp/wc-out}"; mkdir -p "$OUT"
{ nvidia-smi --query-gpu=name,uuid,memory.total,driver_version --format=csv; nvidia-smi topo -m; nproc; df -h /tmp; } \
  > "$OUT/machine.txt" 2>&1
python3 -c "import torch, cuda.bindings; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'gpus', torch.cuda.device_count())" \
  | tee -a "$OUT/machine.txt"
python3 setup.py -q build_ext --inplace > "$OUT/build_ext.log" 2>&1 || echo "C extension not built (see build_ext.log)"
timeout 400 python3 -m pytest -q -p no:cacheprovider ${TP_TESTS:-tests/test_tp_cuda.py tests/test_tensor_parallel.py} 2>&1 \
  | tail -40 | tee "$OUT/tp_tests.log"
tests=${PIPESTATUS[0]}
timeout 480 python3 bench/tp_bench.py --gib "${1:-64}" --out "$OUT" "${@:2}" > "$OUT/tp_bench.log" 2>&1
bench=$?
tail -25 "$OUT/tp_bench.log"
echo "tests exit $tests, bench exit $bench"
exit $(( tests || bench ))
