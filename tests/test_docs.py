"""The docs a user reads before adopting: they exist, their links lead somewhere, they
describe every argument and every error, and they speak of the product only."""
from __future__ import annotations

import dataclasses
import inspect
import pathlib
import re

import pytest

from weightcache_agent import CacheSpec, attach, errors

ROOT = pathlib.Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", ROOT / "bench" / "RESULTS.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
# how a page would speak of its making rather than of the product
WORK_LOG = [re.compile(p, re.IGNORECASE) for p in (
    r"\bissues?\s+#?\d+", r"\(#\d+\)", r"\bdevice tool\b", r"`device` tool", r"\bthis session\b",
    r"\bhelpers?\b(?! function)", r"\bwork[- ]log\b", r"\bTODO\b")]


def anchors(page: pathlib.Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens."""
    found = set()
    for line in page.read_text().splitlines():
        if line.startswith("#"):
            title = line.lstrip("#").strip().lower()
            found.add(re.sub(r"\s", "-", re.sub(r"[^\w\- ]", "", title)))
    return found


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_links_lead_to_files_and_headings_that_exist(page):
    broken = []
    for target in LINK.findall(page.read_text()):
        if re.match(r"[a-z]+:", target):  # http(s), mailto: not checked offline
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(target)
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(target)
    assert broken == [], f"{page.name}: broken links {broken}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_pages_speak_of_the_product_only(page):
    text = page.read_text()
    hits = [m.group(0) for pattern in WORK_LOG for m in pattern.finditer(text)]
    assert hits == [], f"{page.name}: {hits}"


def test_attach_docstring_covers_every_argument():
    doc = inspect.getdoc(attach)
    # each argument described as `name: ...` (or `name=value ...`) somewhere in the text
    missing = [name for name in inspect.signature(attach).parameters
               if not re.search(rf"(^|\s){name}[:=]", doc, re.MULTILINE)]
    assert missing == []


def test_cachespec_docstring_covers_every_field():
    doc = inspect.getdoc(CacheSpec)
    assert doc and not doc.startswith("CacheSpec(")  # its own, not the dataclass's generated signature
    missing = [f.name for f in dataclasses.fields(CacheSpec) if not re.search(rf"^{f.name}:", doc, re.MULTILINE)]
    assert missing == []


def test_troubleshooting_names_every_error_class():
    text = (ROOT / "docs" / "troubleshooting.md").read_text()
    classes = [c.__name__ for c in vars(errors).values()
               if isinstance(c, type) and issubclass(c, errors.WeightCacheError) and c is not errors.WeightCacheError]
    assert len(classes) >= 7
    assert [c for c in classes if f"`{c}`" not in text] == []


def test_readme_shows_every_subcommand_and_the_install_pages():
    readme = (ROOT / "README.md").read_text()
    cli = (ROOT / "node_agent" / "weightcache_agent" / "cli.py").read_text()
    commands = re.findall(r'add_parser\("([a-z]+)"', cli)
    assert len(commands) >= 6
    assert [c for c in commands if f"weightcache {c}" not in readme] == []
    for needed in ("download.pytorch.org/whl/cpu", "helm-sdkpy", "POST /generate", "docs/install.md",
                   "docs/engines.md", "docs/troubleshooting.md", "WEIGHTCACHE_PROGRESS_INTERVAL"):
        assert needed in readme, needed


def test_chart_tests_fail_in_ci_without_helm_sdkpy(tmp_path):
    """What the README promises: where `CI` is set, a missing helm-sdkpy fails the chart's
    lint tests instead of skipping them (on a laptop they skip)."""
    import os
    import subprocess
    import sys

    (tmp_path / "helm_sdkpy.py").write_text("raise ImportError('helm-sdkpy is not installed here')\n")
    env = dict(os.environ, CI="true", PYTHONPATH=os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", "test_helm_lint_passes",
                           str(ROOT / "tests" / "test_chart.py")], capture_output=True, text=True, env=env, timeout=120,
                          cwd=ROOT)
    tail = done.stdout[-2000:]
    assert done.returncode == 1 and "failed" in tail and "skipped" not in tail, tail
    assert "helm-sdkpy is not installed here" in done.stdout


def test_readme_claims_agree_with_measured_and_tested_behaviour():
    """Figures the README gives come from bench/RESULTS.md with the machine they were measured on;
    what it says an engine cannot do, it really cannot."""
    readme = (ROOT / "README.md").read_text()
    results = (ROOT / "bench" / "RESULTS.md").read_text()
    # `weightcache build-native`'s time: one row per machine in docs/install.md, where the README points
    assert "its time per machine is in\n[`docs/install.md`](docs/install.md#the-row-binder-weightcache-build-native)" \
        in readme
    install = (ROOT / "docs" / "install.md").read_text()
    table = install.split("\n### The row binder: `weightcache build-native`\n", 1)[1].split("\n## ", 1)[0]
    timings = [(seconds, machine) for machine, seconds in re.findall(r"^\| (\d+-core [^|]+?) \| ([\d.]+) s \|$",
                                                                    table, re.MULTILINE)]
    assert len(timings) >= 2, table  # each with the machine it was measured on
    for seconds, machine in timings:
        assert re.search(rf"\b{re.escape(seconds)}[\d.]* s\b[^.]*?{machine.split()[0]}", " ".join(results.split())), \
            (seconds, machine)
    # a tensor-parallel engine generates (tests/test_tensor_parallel.py: TP=2 tokens equal TP=1's)
    assert "needs `tp_size` 1" not in readme
    assert "--dist-init tcp://HOST:PORT" in readme and "same\ntokens as `--tp-size 1`" in readme


def test_readme_says_users_build_and_push_the_images_and_the_chart_takes_their_names():
    import yaml

    readme = (ROOT / "README.md").read_text()
    kube = readme.split("\n## On Kubernetes", 1)[1].split("\n## ", 1)[0]
    assert "No images are published" in kube
    commands = " ".join(re.findall(r"```bash\n(.*?)```", kube, re.DOTALL)[0].split())
    values = yaml.safe_load((ROOT / "charts" / "weightcache" / "values.yaml").read_text())
    for image in ("operator", "agent"):
        dockerfile = f"images/{image}.Dockerfile"
        assert (ROOT / dockerfile).exists()
        tag = re.search(rf"docker build -f {dockerfile} -t (\S+) \.", commands).group(1)
        assert f"docker push {tag}" in commands
        assert f"--set {image}.image={tag}" in commands and "image" in values[image]  # a key the chart has


def test_readme_first_screen_says_for_whom_the_three_figures_and_the_two_commands():
    readme = (ROOT / "README.md").read_text()
    results = " ".join((ROOT / "bench" / "RESULTS.md").read_text().split())
    screen = readme[:readme.index("```", readme.index("```bash") + 3) + 3]  # up to the end of the first commands
    assert len(screen.splitlines()) <= 26, len(screen.splitlines())
    assert re.search(r"^For platform teams running LLM inference on GPU fleets", screen, re.MULTILINE)
    rows = [line for line in screen.splitlines() if line.startswith("| ") and not line.startswith("| what")]
    rows = [row for row in rows if not set(row) <= set("|- :")]
    assert [bool(re.search(topic, row)) for row, topic in zip(rows, ("restart", "standby takes over", "cold load"))] \
        == [True, True, True], rows
    for row in rows:
        for figure in re.findall(r"\*\*([^*]+)\*\*|(\d[\d.]*(?:-[\d.]+)? (?:ms|s))\b", row):
            figure = figure[0] or figure[1]
            ends = figure.split()[0].split("-")
            assert figure in results or all(end in results for end in ends), (figure, row)
    commands = re.search(r"```bash\n(.*?)```", screen, re.DOTALL).group(1)
    assert "pip install torch" in commands and "pip install -e . && weightcache demo" in commands


def test_readme_sends_users_to_the_envtest_convention_first_then_the_shared_copy():
    readme = (ROOT / "README.md").read_text()
    tests = readme.split("\n## Run the tests", 1)[1].split("\n## ", 1)[0]
    assert "KUBEBUILDER_ASSETS" in tests and tests.index("KUBEBUILDER_ASSETS") < tests.index("../shared/k8s")
    for binary in ("kube-apiserver", "etcd", "kubectl", "kube-controller-manager", "kube-scheduler"):
        assert f"`{binary}`" in tests
    ci = (ROOT / ".ci" / "run").read_text()
    assert "export KUBEBUILDER_ASSETS" in ci  # CI runs them the same way, from its shared copy


def test_every_docs_page_is_reachable_from_the_readme():
    """A page nobody links to is a page nobody reads: each docs/*.md is linked from the README,
    and the pages a platform team looks for first are in its Documentation table."""
    readme = (ROOT / "README.md").read_text()
    assert [p.name for p in (ROOT / "docs").glob("*.md") if f"](docs/{p.name})" not in readme] == []
    table = readme.split("\n## Documentation\n", 1)[1].split("\n## ", 1)[0]
    for page in ("install", "upgrade", "sizing", "metrics", "compatibility", "engines", "troubleshooting"):
        assert f"| [`docs/{page}.md`](docs/{page}.md) |" in table, page
