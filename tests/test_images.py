"""The images, built as CI builds them and then run: images/build.sh (buildah, no Docker daemon)
on a Debian base made with mmdebstrap, the agent with a CPU torch. Inside the agent image the
agent serves a tiny checkpoint on the cpu backend and an engine attaches (images/smoke.py);
inside the operator image `weightcache-operator --help` runs as the chart's non-root user.

`.ci/run` starts the build in the background before the suite and names its folder in
`$WEIGHTCACHE_IMAGES` (build.log, then build.rc, the archives in out/) and buildah's storage in
`$WEIGHTCACHE_IMAGES_STORAGE` (else storage/ in that folder); these tests wait for build.rc.
Without `$WEIGHTCACHE_IMAGES` they run the build themselves
(a few minutes). Without buildah or mmdebstrap they skip, except where `CI` is set: there
they fail, as they do when the build failed.
"""
from __future__ import annotations

import json
import os
import pathlib
import re
import shlex
import shutil
import subprocess
import time
from collections.abc import Iterator

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
IMAGES = ROOT / "images"
TORCH = "2.13.0"  # the version CI pins (.ci/run), built for CPU into the test images
BUILD_WAIT = 1500.0  # seconds a test waits for the background build, well past its usual 5 to 8 minutes


def dockerfile(name: str) -> str:
    return (IMAGES / f"{name}.Dockerfile").read_text()


def arg(text: str, name: str) -> str:
    return re.search(rf"^ARG {name}=(\S+)$", text, re.MULTILINE).group(1)


# What holds without building anything.

@pytest.mark.parametrize("name", ["agent", "operator", "vllm"])
def test_every_dockerfile_takes_its_base_as_an_argument(name):
    text = dockerfile(name)
    assert re.search(r"^ARG BASE=\S+\nFROM \$\{BASE\}( AS \w+)?$", text, re.MULTILINE), name


def test_agent_image_pins_the_torch_and_cuda_that_docs_install_names():
    text = dockerfile("agent")
    torch_version = arg(text, "TORCH").removeprefix("torch==")
    cuda_index = re.fullmatch(r"https://download\.pytorch\.org/whl/cu(\d+)(\d)", arg(text, "TORCH_INDEX"))
    cuda = f"{cuda_index.group(1)}.{cuda_index.group(2)}"
    assert re.fullmatch(rf"docker.io/nvidia/cuda:{re.escape(cuda)}\.\d+-\w+-ubuntu[\d.]+", arg(text, "BASE"))
    # the compilers are a build stage's; the image's own stage runs `weightcache build-native` without them
    *build, image = re.split(r"^FROM ", text, flags=re.MULTILINE)[1:]
    assert any(re.search(r"apt-get install .*\bg\+\+", stage) for stage in build), build
    assert "weightcache build-native" in image and not re.search(r"\b(gcc|g\+\+|cc|c\+\+)\b", image), image
    install = " ".join((ROOT / "docs" / "install.md").read_text().split())
    assert f"torch {torch_version}" in install and f"CUDA {cuda}" in install, (torch_version, cuda)
    # the image CI builds and runs has the torch the Dockerfile ships
    assert torch_version == TORCH and f"--cpu-torch {TORCH} " in (ROOT / ".ci" / "run").read_text()


def test_operator_image_installs_what_pyproject_says_the_operator_needs():
    pyproject = (ROOT / "pyproject.toml").read_text()
    needed = {*re.findall(r'"([^"]+)"', re.search(r"^operator = \[(.*)\]$", pyproject, re.MULTILINE).group(1)),
              re.search(r'"(pyyaml[^"]*)"', pyproject).group(1)}
    installed = set(re.findall(r'"([a-z-]+[<>=][^"]*)"', dockerfile("operator")))
    assert installed == needed


@pytest.mark.parametrize("argv", [["--debian-base", "vllm"], ["--debian-base", "--cpu-torch", TORCH, "agent", "vllm"]])
def test_build_refuses_the_vllm_image_on_the_debian_base_at_once_in_one_line(argv, tmp_path):
    """vLLM's image is the vllm image's base: on the Debian base its build could only fail, minutes in."""
    began = time.monotonic()
    done = subprocess.run([IMAGES / "build.sh", *argv, "--out", tmp_path / "out"], capture_output=True, text=True,
                          timeout=60)
    assert time.monotonic() - began < 5 and done.returncode == 2, done
    assert done.stderr.splitlines() == ["images/build.sh: the vllm image builds on vLLM's own image (its Dockerfile's "
                                        "BASE), not on --debian-base; build it without --debian-base"], done.stderr
    assert not (tmp_path / "out").exists()  # nothing started


@pytest.mark.parametrize("name", ["agent", "operator", "vllm"])
def test_every_image_carries_the_license_and_says_which(name):
    text = dockerfile(name)
    assert 'org.opencontainers.image.licenses="Apache-2.0"' in re.search(r"^LABEL .*$", text, re.MULTILINE).group(0)
    assert re.search(r"^COPY LICENSE /usr/share/doc/weightcache/LICENSE$", text, re.MULTILINE), name


def minimum_versions() -> dict[str, str]:
    """images/minimum-versions.txt: package -> the oldest release an image may carry."""
    lines = (IMAGES / "minimum-versions.txt").read_text().splitlines()
    pairs = [line.split("#", 1)[0].strip().split(">=") for line in lines if line.split("#", 1)[0].strip()]
    return {name.strip().lower(): version.strip() for name, version in pairs}


def test_the_pip_the_images_pin_is_no_older_than_the_minimum():
    from packaging.version import Version

    for name in ("agent", "operator"):
        pinned = arg(dockerfile(name), "PIP").removeprefix("pip==")
        assert Version(pinned) >= Version(minimum_versions()["pip"]), (name, pinned)


# The built images.

def storage(where: pathlib.Path) -> list[str]:
    """buildah's options for the storage of the build in `where`: .ci/run's kept storage, else its own."""
    given = os.environ.get("WEIGHTCACHE_IMAGES") and os.environ.get("WEIGHTCACHE_IMAGES_STORAGE")
    place = pathlib.Path(given) if given else where / "storage"
    return ["--root", str(place / "root"), "--runroot", str(place / "run")]


def buildah(where: pathlib.Path, *argv: object, timeout: float = 300) -> subprocess.CompletedProcess:
    """buildah on the storage of the build in `where`."""
    conf = where / "containers.conf"
    conf.write_text("[containers]\ndefault_ulimits = []\n")  # a sandbox may not raise ulimits
    return subprocess.run(["buildah", *storage(where), *argv], capture_output=True, text=True,
                          env=dict(os.environ, CONTAINERS_CONF=str(conf)), timeout=timeout)


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> Iterator[pathlib.Path]:
    """The folder of a finished build: out/agent.tar, out/operator.tar, storage/."""
    given = os.environ.get("WEIGHTCACHE_IMAGES")
    if given:
        where = pathlib.Path(given)
    else:
        missing = [tool for tool in ("buildah", "mmdebstrap") if shutil.which(tool) is None]
        if missing:
            if os.environ.get("CI"):
                pytest.fail(f"CI builds the images, but these are not installed: {', '.join(missing)}")
            pytest.skip(f"not installed: {', '.join(missing)} (apt-get install buildah mmdebstrap)")
        where = tmp_path_factory.mktemp("images")
        with open(where / "build.log", "w") as log:
            rc = subprocess.run([IMAGES / "build.sh", "--debian-base", "--cpu-torch", TORCH, "--compression-level", "1",
                                 "--out", where / "out", "--storage", where / "storage"], stdout=log,
                                stderr=subprocess.STDOUT, timeout=BUILD_WAIT).returncode
        (where / "build.rc").write_text(f"{rc}\n")
    deadline = time.monotonic() + BUILD_WAIT
    while not (where / "build.rc").exists():
        assert time.monotonic() < deadline, f"the image build in {where} did not finish in {BUILD_WAIT:.0f} s"
        time.sleep(2)
    log = (where / "build.log").read_text(errors="replace") if (where / "build.log").exists() else ""
    assert (where / "build.rc").read_text().strip() == "0", f"images/build.sh failed:\n{log[-4000:]}"
    yield where
    if not given:  # gigabytes of layers; .ci/run removes its own folder
        buildah(where, "rmi", "--all", "--force")
        shutil.rmtree(where, ignore_errors=True)


class Container:
    """A container of one built image, made from its OCI archive."""

    def __init__(self, built: pathlib.Path, image: str):
        self.built = built
        self.name = self._ok("from", "--quiet", "--pull-never", f"oci-archive:{built / 'out' / f'{image}.tar'}").strip()

    def _ok(self, *argv: str) -> str:
        done = buildah(self.built, *argv)
        assert done.returncode == 0, f"buildah {' '.join(argv[:3])} exited {done.returncode}: {done.stderr[-3000:]}"
        return done.stdout

    def run(self, *command: str, volume: str | None = None) -> str:
        return self._ok("run", "--isolation", "chroot", *(["--volume", volume] if volume else []), self.name, "--",
                        *command)

    def config(self) -> dict:
        return json.loads(self._ok("inspect", "--type", "container", self.name))["OCIv1"]["config"]

    def remove(self) -> None:
        buildah(self.built, "rm", self.name)


@pytest.fixture
def container(built):
    made = []

    def make(image: str) -> Container:
        made.append(Container(built, image))
        return made[-1]

    yield make
    for c in made:
        c.remove()


@pytest.mark.timeout(BUILD_WAIT + 300)  # the first one waits for the build
def test_agent_image_serves_an_engine_on_cpu(container):
    agent = container("agent")
    assert agent.config()["Entrypoint"] == ["weightcache", "agent"]
    report = json.loads(agent.run("python3", "/smoke/smoke.py", volume=f"{IMAGES}:/smoke:ro").strip().splitlines()[-1])
    assert report["package"].startswith("/opt/weightcache/"), report
    assert report["torch"].split("+")[0] == TORCH, report
    assert (report["status_phase"], report["source"], report["equal"]) == ("ready", "agent", True), report
    assert report["bind"] == "torch-native", report  # `weightcache build-native` ran against the image's torch
    # the compiler was only there for the build, and so were the source tree and the build stage's products
    leftovers = agent.run("sh", "-c", "command -v gcc g++ cc c++ || true; ls -d /src /build 2>/dev/null || true")
    assert leftovers.strip() == "", leftovers


@pytest.mark.timeout(BUILD_WAIT + 300)  # the first one waits for the build
def test_operator_image_runs_the_operator_command_as_its_non_root_user(container):
    operator = container("operator")
    config = operator.config()
    assert (config["Entrypoint"], config["User"]) == (["weightcache-operator"], "65532:65532"), config
    out = operator.run("sh", "-c", "id -u; weightcache-operator --help; "
                                   "python3 -c 'import kopf, kubernetes, weightcache_operator.registry'; "
                                   "python3 -c 'import torch' 2>/dev/null && echo torch installed || true")
    uid, _, help_text = out.partition("\n")
    assert uid == "65532" and "--all-namespaces" in help_text and "torch installed" not in out, out


# What the built images hold: what the build used is gone, and what stays is no older than it may be.

CONTENTS = r"""
import glob, importlib.metadata as md, json, os, shutil, subprocess
packages = subprocess.run(["dpkg-query", "-W", "-f", "${Package}\\n"], capture_output=True, text=True).stdout.split()
print(json.dumps({
    "python": {d.metadata["Name"].lower(): d.version for d in md.distributions()},
    "debian": packages,
    "tools": [t for t in ("gcc", "g++", "cc", "c++", "cpp", "ld", "as", "make") if shutil.which(t)],
    "debs": glob.glob("/var/cache/apt/archives/*.deb"),
    "apt_lists": [p for p in glob.glob("/var/lib/apt/lists/*") if os.path.isfile(p) and not p.endswith("/lock")],
    "license": open("/usr/share/doc/weightcache/LICENSE").read(),
}))
"""


@pytest.mark.timeout(BUILD_WAIT + 300)  # the first one waits for the build
@pytest.mark.parametrize("image", ["agent", "operator"])
def test_image_holds_no_build_tools_no_apt_cache_and_no_outdated_python_package(container, image):
    from packaging.version import Version

    c = container(image)
    got = json.loads(c.run("python3", "-c", CONTENTS).strip().splitlines()[-1])
    assert got["tools"] == [] and got["debs"] == [] and got["apt_lists"] == [], got
    # compilers, binutils, headers (gcc-12-base is no compiler: the base system's libgcc needs it)
    build_only = [p for p in got["debian"] if re.fullmatch(r"(gcc|g\+\+|cpp)(-\d+)?|binutils.*|.*-dev", p)]
    assert build_only == [], build_only
    python = got["python"]
    assert python["pip"] == arg(dockerfile(image), "PIP").removeprefix("pip=="), python["pip"]
    assert "setuptools" not in python, python.get("setuptools")
    outdated = {name: version for name, version in python.items()
                if name in minimum_versions() and Version(version) < Version(minimum_versions()[name])}
    assert outdated == {}, outdated
    assert got["license"] == (ROOT / "LICENSE").read_text()
    assert c.config().get("Labels", {}).get("org.opencontainers.image.licenses") == "Apache-2.0", c.config()


@pytest.mark.timeout(BUILD_WAIT + 300)  # the first one waits for the build
def test_the_docs_scan_lines_list_the_agent_images_python_packages(built, tmp_path):
    """docs/install.md's "Scanning the images": its buildah lines as written (buildah on the build's
    storage, as images/build.sh runs it), from a folder holding dist/images/agent.tar; the pip-audit line
    after them needs PyPI's or OSV's vulnerability service, which CI does not reach."""
    install = (ROOT / "docs" / "install.md").read_text()
    block, = [b for b in re.findall(r"```bash\n(.*?)```", install, re.DOTALL) if "oci-archive:dist/images" in b]
    lines = block.strip().splitlines()
    assert lines[-1].startswith("python -m pip install pip-audit && pip-audit "), lines
    (tmp_path / "dist" / "images").mkdir(parents=True)
    (tmp_path / "dist" / "images" / "agent.tar").symlink_to(built / "out" / "agent.tar")
    conf = tmp_path / "containers.conf"
    conf.write_text("[containers]\ndefault_ulimits = []\n")
    # The build's own storage, which holds the archive's image already: the import finds its layers
    # there. A storage of its own would unpack them all again (40 CPU seconds for the agent's).
    wrapper = f"buildah() {{ command buildah {shlex.join(storage(built))} \"$@\"; }}"
    script = "\n".join(["set -e", wrapper, *lines[:-1]])
    done = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=300, cwd=tmp_path,
                          env=dict(os.environ, CONTAINERS_CONF=str(conf), BUILDAH_ISOLATION="chroot"))  # as in a sandbox
    assert done.returncode == 0, done.stderr[-3000:]
    listed = dict(line.split("==", 1) for line in (tmp_path / "agent-packages.txt").read_text().split())
    assert listed["torch"].split("+")[0] == TORCH and "pip" in listed and "weightcache" not in listed, listed
