"""`weightcache build-native` and how an engine finds its build: only the torch it was compiled
against loads it; the command's answers and failures are one line each."""
from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

from security_fixtures import ATTACKER, AsAttacker, agent_dir, needs_root
from weightcache_agent.client import native_build


PACKAGE = Path(native_build.__file__).resolve().parent.parent  # weightcache_agent


@pytest.fixture(scope="module")
def readable_package():
    """A copy of the package that the second uid may read, the one its code imports in these tests.

    The checkout may sit in a home no other uid may enter (a 0700 directory above it), and the
    forked child cannot read what it has not imported yet: the sources `key()` hashes, the modules an
    engine's import runs. An engine of another uid has an install it can read; this copy is that."""
    base = Path(agent_dir())  # every uid may traverse it
    shutil.copytree(PACKAGE, base / PACKAGE.name, ignore=shutil.ignore_patterns("__pycache__"))
    yield base
    shutil.rmtree(base, ignore_errors=True)


def import_from(base: str) -> ModuleType:
    """In the second uid's child: import the package afresh from `base` (torch stays the one loaded);
    its `native_build` module."""
    for name in [m for m in sys.modules if m == PACKAGE.name or m.startswith(PACKAGE.name + ".")]:
        del sys.modules[name]
    sys.path.insert(0, base)
    from weightcache_agent.client import native_build as fresh

    assert Path(fresh.__file__).is_relative_to(base), fresh.__file__
    return fresh


pytestmark = pytest.mark.timeout(900)  # compiles, beside other workers on two cores


def run_cli(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "weightcache_agent.cli", "build-native", *args],
                          capture_output=True, text=True, timeout=600, env={**os.environ, **env})


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


# --- who may plant a build ----------------------------------------------------------------
# Every input of KEY is public, so anyone who can write a place engines look in can name a
# file `_bindtorch-KEY.so`. Its constructor would run as whoever imports it (root, in the
# agent). Only a build owned by the importing user or root, in a directory nobody else may
# write, whose bytes hash to the record made when it was built, is opened at all.

PLANTED_C = """
#include <fcntl.h>
#include <unistd.h>
__attribute__((constructor)) static void planted(void) {
    int fd = open("%s", O_WRONLY | O_CREAT, 0644);
    if (fd >= 0) { write(fd, "ran\\n", 4); close(fd); }
}
"""


def plant(tmp_path: Path, directory: Path, marker: Path) -> Path:
    """A shared object whose constructor writes `marker`, under the running torch's build name."""
    source = tmp_path / "planted.c"
    source.write_text(PLANTED_C % marker)
    target = directory / native_build.library_name(native_build.key())
    subprocess.run(["cc", "-shared", "-fPIC", "-o", str(target), str(source)], check=True)
    return target


def record(so: Path) -> Path:
    """The hash record an attacker would write for its own file."""
    rec = so.with_name(so.name + ".sha256")
    rec.write_text(hashlib.sha256(so.read_bytes()).hexdigest() + "\n")
    return rec


@needs_root
def test_a_build_planted_by_another_user_never_runs_and_check_says_why(native_build_dir, tmp_path, monkeypatch,
                                                                       readable_package):
    # A directory the attacker owns (a shared cache, a volume it may write): it plants a build
    # with a matching hash record, all files its own.
    shared = tmp_path / "shared"
    shared.mkdir()
    marker = tmp_path / "constructor-ran"
    planted = plant(tmp_path, shared, marker)
    record(planted)
    for path in (shared, planted, planted.with_name(planted.name + ".sha256")):
        os.chown(path, ATTACKER, ATTACKER)
    monkeypatch.setenv(native_build.ENV_DIR, str(shared))
    assert native_build.find() is None
    assert native_build.load() is None
    check = run_cli("--check", env={native_build.ENV_DIR: str(shared)})
    assert check.returncode == 1 and "Traceback" not in check.stderr
    assert check.stderr.strip() == (f"weightcache build-native: refusing the build for torch {torch.__version__}: "
                                    f"{shared}: directory owned by uid {ATTACKER}, not by uid 0 or root")
    assert not marker.exists(), "the planted constructor ran"

    # The attacker's own build in its own directory is its to load: a copy of the real build.
    mine = Path(agent_dir()) / "mine"  # a path the other uid may traverse
    mine.mkdir()
    real = native_build_dir / native_build.library_name(native_build.key())
    shutil.copy(real, mine / real.name)
    shutil.copy(real.with_name(real.name + ".sha256"), mine / (real.name + ".sha256"))
    for path in (mine, *mine.iterdir()):
        os.chown(path, ATTACKER, ATTACKER)

    def as_owner(_: dict) -> dict:
        fresh = import_from(str(readable_package))
        os.environ[fresh.ENV_DIR] = str(mine)
        return {"found": str(fresh.find()), "loaded": fresh.load() is not None}

    owner = AsAttacker(as_owner)
    try:
        assert owner.ask() == {"found": str(mine / real.name), "loaded": True}
    finally:
        owner.close()
    monkeypatch.setenv(native_build.ENV_DIR, str(mine))
    assert native_build.find() is None, "root does not load another user's build"


@needs_root
def test_a_build_is_refused_in_a_directory_others_may_write_or_when_its_bytes_changed(native_build_dir, tmp_path,
                                                                                      monkeypatch):
    real = native_build_dir / native_build.library_name(native_build.key())
    place = tmp_path / "builds"
    place.mkdir()
    copy = place / real.name
    shutil.copy(real, copy)
    shutil.copy(real.with_name(real.name + ".sha256"), place / (real.name + ".sha256"))
    monkeypatch.setenv(native_build.ENV_DIR, str(place))
    assert native_build.find() == copy and native_build.load() is not None  # root's own, intact: loads

    place.chmod(0o777)  # anyone could have swapped the file in
    assert native_build.find() is None
    assert native_build.refusals() == [f"{place}: directory writable by group or others (mode 0777)"]
    place.chmod(0o755)
    copy.chmod(0o666)
    assert native_build.refusals() == [f"{copy}: file writable by group or others (mode 0666)"]
    copy.chmod(0o755)

    # Root's own file with other bytes (replaced after the build): the constructor never runs.
    marker = tmp_path / "constructor-ran"
    plant(tmp_path, place, marker)
    assert native_build.refusals() == [f"{copy}: content does not match the hash recorded when it was built"]
    assert native_build.load() is None and native_build.load(copy) is None
    (place / (real.name + ".sha256")).unlink()
    assert native_build.refusals() == [f"{place / (real.name + '.sha256')}: missing (rebuild with weightcache "
                                       "build-native)"]
    assert native_build.load() is None
    assert not marker.exists(), "a build that failed a check was opened"


@needs_root
def test_an_unreadable_home_does_not_break_the_import(tmp_path, readable_package):
    """An engine of another uid whose $HOME it may not enter (or that has none) still imports the
    client and binds without the native build."""
    home = tmp_path / "home"
    home.mkdir(mode=0o700)

    def import_as_other(_: dict) -> dict:
        os.environ.pop(native_build.ENV_DIR, None)
        os.environ["HOME"] = str(home)
        fresh = import_from(str(readable_package))
        # What an engine's import does: looks for a build, here in $HOME too.
        from weightcache_agent.client import rebind  # noqa: F401
        found_with_home = fresh.find()
        del os.environ["HOME"]
        return {"with_home": str(found_with_home), "without_home": str(fresh.find()),
                "loaded": fresh.load() is not None, "beside": os.path.dirname(fresh.__file__)}

    other = AsAttacker(import_as_other)
    try:
        answer = other.ask()
    finally:
        other.close()
    # The unreadable $HOME changes nothing: the same build (or none) is found either way, and only a
    # build root made beside the package (an image's build step) may load.
    assert answer["with_home"] == answer["without_home"]
    assert answer["without_home"] == "None" or os.path.dirname(answer["without_home"]) == answer["beside"]
    assert answer["loaded"] == (answer["without_home"] != "None")


def test_remove_deletes_every_build_where_engines_look_and_nothing_else(tmp_path):
    """`build-native --remove`, before `pip uninstall`: the builds of any torch and their hash records go,
    each named once; other files stay; a second run says there is nothing left."""
    place, extra = tmp_path / "place", tmp_path / "into"
    place.mkdir()
    extra.mkdir()
    planted = [place / "_bindtorch-0123456789abcdef.so", place / "_bindtorch-0123456789abcdef.so.sha256",
               place / "_bindtorch-fedcba9876543210.so", extra / "_bindtorch-0123456789abcdef.so"]
    kept = [place / "_bindfast.so", place / "notes.txt", extra / "_bindtorch.cpp"]
    for path in planted + kept:
        path.write_text("x")
    done = run_cli("--remove", "--into", str(extra), env={native_build.ENV_DIR: str(place)})
    assert done.returncode == 0, done.stderr
    assert sorted(done.stdout.splitlines()) == sorted(f"removed {p}" for p in planted)
    assert [p for p in planted if p.exists()] == [] and all(p.exists() for p in kept)
    again = run_cli("--remove", env={native_build.ENV_DIR: str(place)})
    assert (again.returncode, again.stdout.strip()) == (0, f"no build to remove in {place}"), again
    both = run_cli("--remove", "--check", env={native_build.ENV_DIR: str(place)})
    assert both.returncode == 2 and both.stderr.strip().splitlines()[-1] == \
        "weightcache build-native: --check and --remove are two commands: give one", both.stderr
