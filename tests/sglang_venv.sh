#!/usr/bin/env bash
# A virtual environment with SGLang 0.5.17 for tests/test_sglang.py. Prints the environment's python:
# export it as WEIGHTCACHE_SGLANG_PYTHON.
#   tests/sglang_venv.sh [DIR]        (default: .venv-sglang in the checkout)
#   tests/sglang_venv.sh --print      the install lines it runs, and nothing else
# The install is docs/sglang.md's test environment, its lines run as written (the ```bash block that
# writes sglang-cpu.txt) by tests/docs_venv.sh, in the environment DIR, from the checkout.
WEIGHTCACHE_VENV_CALLER=$0 exec "$(dirname "$0")/docs_venv.sh" docs/sglang.md 'sglang-cpu\.txt' .venv-sglang "$@"
