#!/usr/bin/env bash
# A virtual environment installed by a docs page's own lines, for tests that run an engine in an
# environment of its own (tests/vllm_venv.sh, tests/sglang_venv.sh call it). Prints the environment's python.
#   tests/docs_venv.sh DOC MARK DEFAULT [DIR]   the first ```bash block of DOC whose text matches the awk
#                                               regex MARK, run as written from the checkout, in DIR
#                                               (default: DEFAULT in the checkout)
#   tests/docs_venv.sh DOC MARK DEFAULT --print the install lines it runs, and nothing else
# What CI tests is what the docs tell users.
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
doc=$1 mark=$2 default=$3; shift 3
caller=tests/$(basename "${WEIGHTCACHE_VENV_CALLER:-$0}")
block=$(awk -v mark="$mark" '/^```bash$/ { inside = 1; text = ""; next }
             /^```$/ && inside { inside = 0; if (text ~ mark) { printf "%s", text; exit } next }
             inside { text = text $0 "\n" }' "$here/$doc")
[ -n "$block" ] || { echo "$caller: no install block matching /$mark/ in $doc" >&2; exit 1; }
if [ "${1:-}" = --print ]; then printf '%s\n' "$block"; exit 0; fi
dir=$(realpath -m "${1:-$here/$default}")
command -v uv >/dev/null || python3 -m pip install -q uv
# One exception, said on stderr: a machine that cannot reach PyTorch's CPU index but has a local wheel
# directory for pip (PIP_FIND_LINKS, holding torch 2.13.0+cpu) takes torch from there instead.
index="--extra-index-url https://download.pytorch.org/whl/cpu"
if [ -n "${PIP_FIND_LINKS:-}" ] && ! python3 -c 'import urllib.request as u; u.urlopen("https://download.pytorch.org/whl/cpu/torch/", timeout=10)' 2>/dev/null; then
  echo "$caller: download.pytorch.org does not answer here: '$index' run as '--find-links $PIP_FIND_LINKS'" >&2
  block=${block//"$index"/--find-links $PIP_FIND_LINKS}
fi
uv venv -q --allow-existing -p python3.11 "$dir" 2>/dev/null || uv venv -q --allow-existing "$dir"
# as `source DIR/bin/activate` would, then the docs' lines; their output to stderr (stdout is the python).
# UV_COMPILE_BYTECODE: uv writes no .pyc by default, and where PYTHONDONTWRITEBYTECODE is set (CI
# machines) no import ever writes one, so every engine process would compile its engine's, transformers'
# and torch's modules again (vLLM: 21,000 modules, half of its 30 s import on two cores).
(cd "$here" && export VIRTUAL_ENV=$dir PATH=$dir/bin:$PATH UV_COMPILE_BYTECODE=1 && bash -euo pipefail -c "$block") >&2
echo "$dir/bin/python"
