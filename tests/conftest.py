"""Fixtures shared across test modules, each made once per session: the real Kubernetes
control plane, and the torch-native row binder compiled for this torch."""
from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator

import pytest

import k8s_lab as lab_module
from k8s_lab import Lab, unavailable_reason

# How the suite is spread over pytest-xdist's workers (`--dist loadgroup`, set in pyproject.toml):
# each module is one unit, so its module-scoped agents and engines start once; the tests on a real
# control plane share one unit, so it is started once. The EngineSet example's four vLLM engines,
# on a control plane of their own, are a unit of their own that starts first beside test_vllm's
# engines: the two longest units of the run. What several units need compiled is compiled once
# (`native_build_dir`).
K8S_UNIT = "k8s-lab"
VLLM_EXAMPLE_UNIT = "vllm-example"
VLLM_EXAMPLE_TESTS = {"test_vllm_engineset_serves_and_fails_over_as_shipped"}


# The torch-native binder's compile (docs/install.md gives its time per machine) takes minutes while
# the run starts its engines and control planes beside it: the tests whose setup may wait for it
# get that time on top of their own.
NATIVE_BUILD_TIMEOUT = 900
NATIVE_FIXTURES = {"native", "native_build_dir", "torch_rows"}


# The longest units (as measured by `--durations=0` in CI), handed out first: started last, one of
# them would run alone at the end of the run.
LONGEST_FIRST = (VLLM_EXAMPLE_UNIT, "test_vllm", K8S_UNIT, "test_wheel", "test_bind_manifest", "test_agent_client",
                 "test_native_build", "test_first_day", "test_rolling_upgrade", "test_k8s_install_uninstall", "test_prepare",
                 "test_cli_mistakes", "test_engineset_kmock", "test_demo", "test_demo_narration")


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook reads the groups
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    units = {}
    for item in items:
        if item.originalname in VLLM_EXAMPLE_TESTS:
            unit = VLLM_EXAMPLE_UNIT
        elif {"k8s_lab", "k8s_chart"} & set(getattr(item, "fixturenames", ())):
            unit = K8S_UNIT
        else:
            unit = item.path.stem
        item.add_marker(pytest.mark.xdist_group(unit))
        if NATIVE_FIXTURES & set(getattr(item, "fixturenames", ())) and item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(NATIVE_BUILD_TIMEOUT + 300))  # its setup may wait for the compile
        units[item.nodeid] = unit
    rank = {unit: i for i, unit in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(units[item.nodeid], len(rank)))  # stable: the rest keep their order


# Where a run's CPU goes: on a machine of two cores the suite's wall time is bounded below by its CPU
# seconds over two, so CI's time is cut by cutting these. Each phase of a test reports the CPU its
# worker and the processes the worker reaped spent since the previous phase; the summary adds them
# up per unit. A control plane's processes run detached: what they spent is read from /proc when the
# worker stops them and counted in the phase that stops them. docs/development.md gives a whole
# run's, from the kernel's process accounting.
_cpu_mark = [0.0]
_cpu_by_unit: dict[str, float] = {}


def _cpu_seconds() -> float:
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system + lab_module.detached_cpu_s[0]


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    outcome = yield
    now = _cpu_seconds()
    outcome.get_result().user_properties.append(("cpu_s", now - (_cpu_mark[0] or now)))
    _cpu_mark[0] = now


# The time bars tests assert (`time_bar`), each with what it measured: the summary lists them by
# how close they came, so a bound that holds only on a quiet machine shows in a passing run first.
_time_bars: dict[tuple[str, str], tuple[float, float]] = {}


@pytest.fixture
def time_bar(request: pytest.FixtureRequest):
    """`time_bar(what, seconds, bound)` asserts seconds < bound (`<=` with inclusive=True) and reports it."""
    def check(what: str, seconds: float, bound: float, *, inclusive: bool = False, detail: object = "") -> None:
        request.node.user_properties.append(("time_bar", (what, seconds, bound)))
        held = seconds <= bound if inclusive else seconds < bound
        assert held, f"{what}: {seconds:.3f} s, bound {bound:.3f} s {detail}"
    return check


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.when == "call":
        for name, value in report.user_properties:
            if name == "time_bar":
                what, seconds, bound = value
                _time_bars[(report.nodeid.split("@")[0], what)] = (seconds, bound)
    spent = dict(report.user_properties).get("cpu_s")
    if spent is not None:
        unit = report.nodeid.rpartition("@")[2] if "@" in report.nodeid else report.nodeid.split("::")[0]
        _cpu_by_unit[unit] = _cpu_by_unit.get(unit, 0.0) + spent


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    if _time_bars:
        terminalreporter.write_sep("=", f"time bars: {len(_time_bars)} measured, closest to their bound first")
        for (nodeid, what), (seconds, bound) in sorted(_time_bars.items(), key=lambda kv: -kv[1][0] / kv[1][1]):
            terminalreporter.write_line(f"{seconds:8.3f}s of {bound:6.2f}s ({seconds / bound:4.0%})  {what}  "
                                        f"[{nodeid.split('::')[-1][:70]}]")
    if not _cpu_by_unit:
        return
    total = sum(_cpu_by_unit.values())
    terminalreporter.write_sep("=", f"CPU seconds by unit: {total:.0f} s in all")
    for unit, spent in sorted(_cpu_by_unit.items(), key=lambda kv: -kv[1])[:20]:
        terminalreporter.write_line(f"{spent:8.1f}s  {unit}")


@contextlib.contextmanager
def _running_lab() -> Iterator[Lab]:
    reason = unavailable_reason()
    if reason:
        pytest.skip(f"no Kubernetes control plane: {reason}")
    lab = Lab.start()
    try:
        yield lab
    finally:
        lab.stop()
    left = lab.leftover_pids()
    assert not left, f"control-plane processes left running: {left}"


def _with_chart(lab: Lab) -> Lab:
    from k8s_lab import install_or_upgrade_chart

    try:
        import helm_sdkpy  # noqa: F401
    except Exception as e:
        if os.environ.get("CI"):
            raise
        pytest.skip(f"helm-sdkpy not available: {e}")
    install_or_upgrade_chart(lab)
    # No pod for the chart's operator Deployment: a test that needs the operator runs it as a
    # local process against the lab, and a fake kubelet must not find an operator pod to run.
    deployments = "/apis/apps/v1/namespaces/weightcache-system/deployments"
    for deployment in lab.api.get(deployments)["items"]:  # `kubectl scale deployment --all --replicas=0`
        lab.api.patch(f"{deployments}/{deployment['metadata']['name']}/scale", {"spec": {"replicas": 0}})
    return lab


@pytest.fixture(scope="session")
def k8s_lab() -> Iterator[Lab]:
    """A running control plane with nodes node-1 and node-2, the GPU DeviceClass and the CRDs.

    Skips where the control-plane scripts or etcd are absent. Started once per session and
    stopped (down.sh --wipe, nothing left running) at its end.
    """
    with _running_lab() as lab:
        yield lab


@pytest.fixture(scope="session")
def k8s_chart(k8s_lab: Lab) -> Lab:
    """The lab with the project's Helm chart installed (release `weightcache` in namespace
    `weightcache-system`): the operator's RBAC, the agent's ClusterRole and the
    ValidatingAdmissionPolicy; its operator Deployment scaled to 0. Needs helm-sdkpy."""
    return _with_chart(k8s_lab)


@pytest.fixture
def own_k8s_chart() -> Iterator[Lab]:
    """As `k8s_chart`, on a control plane of the test's own, stopped when the test ends: for a unit of
    one test on a worker of its own, whose control plane would otherwise idle there (about 4 CPU
    seconds a minute) until the run ends."""
    with _running_lab() as lab:
        yield _with_chart(lab)


@pytest.fixture(scope="session")
def native_build_dir(tmp_path_factory):
    """A directory holding the torch-native row binder compiled for this torch by `weightcache
    build-native` (a real compile, its time per machine in docs/install.md; once per run of the suite)."""
    from weightcache_agent.client import native_build
    from weightcache_agent.client.rebind import _bindfast

    if _bindfast is None:
        pytest.skip("C extension not built")
    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        if os.environ.get("CI"):
            pytest.fail(f"no C++ compiler {compiler!r} in CI: the torch-native binder goes untested")
        pytest.skip(f"no C++ compiler {compiler!r}")
    # One compile for the whole run: the workers' base directories share a parent, and the first
    # worker to take the lock builds there while the others wait for it.
    into = tmp_path_factory.getbasetemp().parent / "native"
    into.mkdir(exist_ok=True)
    with open(into / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (into / native_build.library_name(native_build.key())).exists():
            done = subprocess.run([sys.executable, "-m", "weightcache_agent.cli", "build-native", "--into", str(into)],
                                  capture_output=True, text=True, timeout=NATIVE_BUILD_TIMEOUT)
            assert done.returncode == 0, done.stderr
            assert str(into / native_build.library_name(native_build.key())) in done.stdout
    return into


@pytest.fixture(scope="session")
def torch_rows(native_build_dir):
    """The row binder's function table, loaded from that build."""
    from weightcache_agent.client import native_build

    rows = native_build.load(native_build_dir / native_build.library_name(native_build.key()))
    assert rows is not None
    return rows
