#!/usr/bin/env bash
# Tensor parallelism on one node of two GPUs, in one device call: the GPU tests, then the benchmark.
# Usage on the device machine: bash bench/tp_suite.sh [GIB] [tp_bench.py flags]   (tables and logs in $OUT)
#   TP_TESTS: the tests to run first (default: every test that needs a GPU, and the cpu tensor-parallel
#   tests); TP_TESTS=none skips them. TP_BENCH_TIMEOUT: seconds the benchmark may take (default 480).
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
TIMEFORMAT="python3 -c 'import torch': %R s wall"
for i in 1 2; do  # what every engine process pays first: the interpreter and torch's import
  { time python3 -c "import torch"; } 2>&1 | tee -a "$OUT/machine.txt"
done
{ echo "torch's import, slowest modules (cumulative us):"; python3 -X importtime -c "import torch" 2>&1 | sort -t'|' -k2 -n | tail -8
  python3 -c "import os, torch; d = os.path.dirname(torch.__file__); print('torch package writable:', os.access(d, os.W_OK), '__pycache__:', os.path.isdir(os.path.join(d, '__pycache__')))"
} >> "$OUT/machine.txt" 2>&1
python3 setup.py -q build_ext --inplace > "$OUT/build_ext.log" 2>&1 || echo "C extension not built (see build_ext.log)"
tail -3 "$OUT/build_ext.log" >> "$OUT/machine.txt"; rm -f "$OUT/build_ext.log"
TP_TESTS="${TP_TESTS:-tests/test_cuda_backend.py tests/test_tp_cuda.py tests/test_prepare.py tests/test_transformers.py \
tests/test_materialize.py tests/test_tensor_parallel.py tests/test_supervisor.py::test_cuda_node_sockets_named_by_gpu_uuid}"
tests=0
if [ "$TP_TESTS" != none ]; then
  timeout 420 python3 -m pytest -q -p no:cacheprovider -o addopts="" -rfE $TP_TESTS 2>&1 | tail -60 > "$OUT/gpu_tests.log"
  tests=${PIPESTATUS[0]}
  tail -5 "$OUT/gpu_tests.log"
fi
timeout "${TP_BENCH_TIMEOUT:-480}" python3 bench/tp_bench.py --gib "${1:-64}" --out "$OUT" "${@:2}" > "$OUT/tp_bench.log" 2>&1
bench=$?
tail -25 "$OUT/tp_bench.log"
echo "tests exit $tests, bench exit $bench"
exit $(( tests || bench ))
