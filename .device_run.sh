#!/usr/bin/env bash
set -uo pipefail
export PYTHONPATH="$PWD/node_agent:$PWD/operator" PYTHONUNBUFFERED=1
S=$(date +%s); t() { echo "[$(( $(date +%s) - S )) s] $*"; }
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/gpu.txt; nproc
python3 setup.py -q build_ext --inplace > $OUT/build_ext.log 2>&1 || echo "build_ext failed"
t build-native; python3 -m weightcache_agent.cli build-native 2>&1 | tee $OUT/build_native.log
python3 -c "from weightcache_agent.client.rebind import _bindfast, _torch_rows; print('C', bool(_bindfast), 'C++', bool(_torch_rows))"
rm -rf /tmp/c-only && cp -r node_agent /tmp/c-only && rm -f /tmp/c-only/weightcache_agent/client/_bindtorch-*.so
t tests; timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_cuda_backend.py tests/test_bind_manifest.py tests/test_packed_rows.py tests/test_prepare.py > $OUT/gpu_tests.log 2>&1; tail -3 $OUT/gpu_tests.log
t gpu_bench; timeout 200 python3 bench/gpu_bench.py --gib 8 --no-cold --out $OUT > $OUT/gpu_bench.log 2>&1; tail -22 $OUT/gpu_bench.log
t after_stream; timeout 150 python3 bench/after_stream.py cuda --model /tmp/wc-gpu-bench/llama-8g --tree c=/tmp/c-only --rounds 4 --budget 95 --out $OUT > $OUT/after_stream.log 2>&1; tail -6 $OUT/after_stream.log
t fresh; timeout 100 python3 bench/fresh_process.py cuda --model /tmp/wc-gpu-bench/llama-8g --fresh 5 --sections attach --out $OUT > $OUT/fresh_process.log 2>&1; tail -8 $OUT/fresh_process.log
t done
