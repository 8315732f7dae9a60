#!/usr/bin/env bash
# A virtual environment with SGLang 0.5.17 for tests/test_sglang.py. Prints the environment's python:
# export it as WEIGHTCACHE_SGLANG_PYTHON.
#   tests/sglang_venv.sh [DIR]        (default: .venv-sglang in the checkout)
#   tests/sglang_venv.sh --print      the install lines it runs, and nothing else
# The install is docs/sglang.md's test environment, its lines run as written (the ```bash block that
# writes sglang-cpu.txt), in the environment DIR, from the checkout: what CI tests is what the docs say.
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
block=$(awk '/^```bash$/ { inside = 1; text = ""; next }
             /^```$/ && inside { inside = 0; if (text ~ /sglang-cpu\.txt/) { printf "%s", text; exit } next }
             inside { text = text $0 "\n" }' "$here/docs/sglang.md")
[ -n "$block" ] || { echo "tests/sglang_venv.sh: no test install block in docs/sglang.md" >&2; exit 1; }
if [ "${1:-}" = --print ]; then printf '%s\n' "$block"; exit 0; fi
dir=$(realpath -m "${1:-$here/.venv-sglang}")
command -v uv >/dev/null || python3 -m pip install -q uv
# As tests/vllm_venv.sh: PyTorch's CPU index, or where it does not answer, pip's local wheel directory.
index="--extra-index-url https://download.pytorch.org/whl/cpu"
if [ -n "${PIP_FIND_LINKS:-}" ] && ! python3 -c 'import urllib.request as u; u.urlopen("https://download.pytorch.org/whl/cpu/torch/", timeout=10)' 2>/dev/null; then
  echo "tests/sglang_venv.sh: download.pytorch.org does not answer here: '$index' run as '--find-links $PIP_FIND_LINKS'" >&2
  block=${block//"$index"/--find-links $PIP_FIND_LINKS}
fi
uv venv -q --allow-existing -p python3.11 "$dir" 2>/dev/null || uv venv -q --allow-existing "$dir"
# UV_COMPILE_BYTECODE: each test starts SGLang in fresh processes; without .pyc files each import
# compiles SGLang's and transformers' modules again
(cd "$here" && export VIRTUAL_ENV=$dir PATH=$dir/bin:$PATH UV_COMPILE_BYTECODE=1 && bash -euo pipefail -c "$block") >&2
echo "$dir/bin/python"
