"""`weightcache build-native` and how an engine finds its build: only the torch it was compiled
against loads it; the command's answers and failures are one line each."""
from __future__ import annotations

import os
import subprocess
import sys

import torch

from weightcache_agent.client import native_build


def run_cli(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "weightcache_agent.cli", "build-native", *args],
                          capture_output=True, text=True, timeout=280, env={**os.environ, **env})


def test_a_build_is_found_only_by_the_torch_it_was_built_for(native_build_dir, monkeypatch):
    monkeypatch.setenv(native_build.ENV_DIR, str(native_build_dir))
    assert native_build.find() == native_build_dir / native_build.library_name(native_build.key())
    assert native_build.load() is not None
    monkeypatch.setattr(torch, "__version__", "9.9.9+upgraded")
    assert native_build.find() is None, "a build for another torch is never loaded"
    assert native_build.load() is None


def test_check_says_whether_the_running_torch_has_a_build(native_build_dir, tmp_path):
    found = run_cli("--check", env={native_build.ENV_DIR: str(native_build_dir)})
    assert found.returncode == 0 and str(native_build_dir) in found.stdout, found.stderr
    missing = run_cli("--check", env={native_build.ENV_DIR: str(tmp_path)})
    assert missing.returncode == 1
    assert missing.stderr.strip() == (f"weightcache build-native: no build for torch {torch.__version__} "
                                      f"(key {native_build.key()}); run weightcache build-native")


def test_a_build_without_a_compiler_fails_in_one_line_and_leaves_nothing(tmp_path):
    done = run_cli("--into", str(tmp_path), env={"CXX": str(tmp_path / "no-such-c++")})
    assert done.returncode == 1
    assert done.stderr.splitlines()[-1] == f"weightcache build-native: no C++ compiler '{tmp_path / 'no-such-c++'}' " \
                                          "(install g++, or set CXX)"
    assert "Traceback" not in done.stderr
    assert list(tmp_path.iterdir()) == []


def test_a_compiler_that_refuses_fails_in_one_line_and_leaves_nothing(tmp_path):
    refusing = tmp_path / "bin" / "c++"
    refusing.parent.mkdir()
    refusing.write_text("#!/bin/sh\necho 'fatal error: torch/csrc/autograd/python_variable.h: No such file' >&2\nexit 1\n")
    refusing.chmod(0o755)
    into = tmp_path / "out"
    done = run_cli("--into", str(into), env={"CXX": str(refusing)})
    assert done.returncode == 1 and "Traceback" not in done.stderr
    assert done.stderr.splitlines()[-1].startswith(f"weightcache build-native: {refusing} failed (exit 1): fatal error")
    assert list(into.iterdir()) == [], "no partial file left behind"
