"""The engine pods' compile cache, as render_pod writes it: volume, mount, variables, directory key.

Real pods rendered through ``render_pod`` from parsed specs (nothing of the operator mocked),
validated against the Kubernetes schema; the chart's values against the operator's defaults.
"""
from __future__ import annotations

import copy
import json
import subprocess
import sys
from typing import Any

import kubernetes_validate
import pytest
import yaml

from operator_fixtures import CHART
from weightcache_operator.api.v1alpha1.engineset_types import parse_engineset
from weightcache_operator.api.v1alpha1.weightcache_types import SpecError, parse_spec
from weightcache_operator.config import OperatorConfig
from weightcache_operator.controller.engineset.compile_cache import (
    COMPILE_CACHE_ENV_NAMES,
    check_template_host_paths,
)
from weightcache_operator.controller.engineset.manifests import render_pod, template_hash
from weightcache_operator.controller.engineset.placement import Placement

CONFIG = OperatorConfig()
CACHE = parse_spec({"model": {"path": "qwen"}, "parallelism": {"tensor": 1}, "dtype": "bfloat16"})
GROUP = Placement(0, "node-a", ("GPU-a0",))
MOUNT = "/var/cache/weightcache-compile"
TEMPLATE: dict[str, Any] = {"spec": {"containers": [
    {"name": "vllm", "image": "vllm:0.24", "env": [{"name": "TRITON_CACHE_DIR", "value": "/mine/triton"}]},
]}}


def engineset(template: dict[str, Any] = TEMPLATE, **spec: Any) -> Any:
    return parse_engineset("chat", {"cacheRef": {"name": "qwen"}, "template": template, **spec})


def pod(es: Any = None, cache: Any = CACHE, config: OperatorConfig = CONFIG, ns: str = "ml",
        name: str = "chat") -> dict[str, Any]:
    return render_pod(es or engineset(), cache, config, ns, name, GROUP, 0)


def cache_dir(p: dict[str, Any]) -> str | None:
    found = [v["hostPath"]["path"] for v in p["spec"]["volumes"] if v["name"] == "weightcache-compile-cache"]
    return found[0] if found else None


def env_of(c: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value") for e in c.get("env") or []}


def test_the_pod_gets_the_volume_the_mount_and_the_variables() -> None:
    p = pod()
    kubernetes_validate.validate(p, kubernetes_validate.utils.latest_version(), strict=True)
    volume = [v for v in p["spec"]["volumes"] if v["name"] == "weightcache-compile-cache"]
    assert len(volume) == 1 and volume[0]["hostPath"]["type"] == "DirectoryOrCreate"
    directory = volume[0]["hostPath"]["path"]
    assert directory.startswith("/var/lib/weightcache/compile-cache/ml/chat/")
    key = directory.rsplit("/", 1)[1]
    assert len(key) == 16 and all(ch in "0123456789abcdef" for ch in key)
    (c,) = p["spec"]["containers"]
    assert {"name": "weightcache-compile-cache", "mountPath": MOUNT} in c["volumeMounts"]
    env = env_of(c)
    assert env["VLLM_CACHE_ROOT"] == f"{MOUNT}/vllm"
    assert env["TORCHINDUCTOR_CACHE_DIR"] == f"{MOUNT}/torchinductor"
    assert env["DG_JIT_CACHE_DIR"] == env["SGLANG_DG_CACHE_DIR"] == f"{MOUNT}/deep_gemm"
    assert env["FLASHINFER_WORKSPACE_BASE"] == f"{MOUNT}/flashinfer"
    assert set(COMPILE_CACHE_ENV_NAMES) <= set(env)
    # The template's own variable wins, once: not replaced, not repeated.
    assert env["TRITON_CACHE_DIR"] == "/mine/triton"
    assert [e["name"] for e in c["env"]].count("TRITON_CACHE_DIR") == 1
    # The operator's WEIGHTCACHE_* environment is still there.
    assert env["WEIGHTCACHE_MODEL"] == "/models/qwen"


def test_a_template_volume_or_mount_of_the_same_name_or_path_is_replaced() -> None:
    template = copy.deepcopy(TEMPLATE)
    template["spec"]["volumes"] = [{"name": "weightcache-compile-cache", "emptyDir": {}}]
    template["spec"]["containers"][0]["volumeMounts"] = [{"name": "weightcache-compile-cache", "mountPath": "/x"}]
    p = pod(engineset(template))
    assert [v for v in p["spec"]["volumes"] if v["name"] == "weightcache-compile-cache"][0]["hostPath"]
    assert [m for m in p["spec"]["containers"][0]["volumeMounts"] if m["name"] == "weightcache-compile-cache"] == [
        {"name": "weightcache-compile-cache", "mountPath": MOUNT}]


def test_namespaces_engine_sets_and_images_get_their_own_directories() -> None:
    a, b = cache_dir(pod(ns="team-a")), cache_dir(pod(ns="team-b"))
    assert a and b and a != b and "/team-a/chat/" in a and "/team-b/chat/" in b
    assert cache_dir(pod(name="other")) != cache_dir(pod())
    other = copy.deepcopy(TEMPLATE)
    other["spec"]["containers"][0]["image"] = "vllm:0.25"
    assert cache_dir(pod(engineset(other))).rsplit("/", 1)[1] != cache_dir(pod()).rsplit("/", 1)[1]
    for change in ({"dtype": "float16"}, {"quantization": "fp8-block"}, {"parallelism": {"tensor": 2}},
                   {"model": {"path": "qwen", "revision": "r2"}}):
        cs = parse_spec({"model": {"path": "qwen"}, "parallelism": {"tensor": 1}, "dtype": "bfloat16", **change})
        assert cache_dir(pod(cache=cs)) != cache_dir(pod()), change
    # Another slot, group or node of the same EngineSet: the same directory.
    assert cache_dir(render_pod(engineset(), CACHE, CONFIG, "ml", "chat", Placement(3, "node-b", ("G",)), 2)) == \
        cache_dir(pod())


def test_the_same_spec_gives_the_same_directory_in_another_operator_process() -> None:
    here = cache_dir(pod())
    reordered = {"spec": {"containers": [{"env": TEMPLATE["spec"]["containers"][0]["env"], "image": "vllm:0.24",
                                          "name": "vllm"}]}}
    assert cache_dir(pod(engineset(reordered))) == here  # key order of the spec does not matter
    code = ("import json, sys; sys.path.insert(0, 'tests'); import test_compile_cache as t; "
            "print(json.dumps(t.cache_dir(t.pod())))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={"PYTHONHASHSEED": "12345", "PATH": "/usr/bin:/bin"}, cwd=str(CHART.parent.parent))
    assert json.loads(out.stdout.strip().splitlines()[-1]) == here


def test_off_adds_nothing_and_rolls_only_when_turned_off_on_the_engine_set() -> None:
    for p in (pod(engineset(compileCache={"enabled": False})), pod(config=CONFIG.replace(compile_cache=False))):
        assert cache_dir(p) is None
        c = p["spec"]["containers"][0]
        assert MOUNT not in str(c["volumeMounts"])
        assert set(env_of(c)) & set(COMPILE_CACHE_ENV_NAMES) == {"TRITON_CACHE_DIR"}  # the template's own
    base = template_hash(engineset(), CACHE, CONFIG)
    # An operator upgrade, or a new root, moves no running pod; turning it off on the EngineSet rolls it.
    assert template_hash(engineset(compileCache={"enabled": True}), CACHE, CONFIG) == base
    assert template_hash(engineset(), CACHE, CONFIG.replace(compile_cache_root="/srv/cc")) == base
    assert template_hash(engineset(), CACHE, CONFIG.replace(compile_cache=False)) == base
    assert template_hash(engineset(compileCache={"enabled": False}), CACHE, CONFIG) != base
    with pytest.raises(SpecError):
        engineset(compileCache={"enabled": "no"})


def test_containers_the_template_runs_as_another_user_get_no_cache() -> None:
    template = {"spec": {"securityContext": {"runAsUser": 1000}, "containers": [
        {"name": "engine", "image": "e:1"},
        {"name": "root", "image": "e:1", "securityContext": {"runAsUser": 0}}]}}
    p = pod(engineset(template))
    engine, root = p["spec"]["containers"]
    assert MOUNT not in str(engine["volumeMounts"]) and "VLLM_CACHE_ROOT" not in env_of(engine)
    assert MOUNT in str(root["volumeMounts"]) and cache_dir(p)
    nonroot = {"spec": {"containers": [{"name": "e", "image": "e:1", "securityContext": {"runAsNonRoot": True}}]}}
    assert cache_dir(pod(engineset(nonroot))) is None


@pytest.mark.parametrize("path", ["/var/lib/weightcache/compile-cache", "/var/lib/weightcache/compile-cache/ml/x",
                                  "/var/lib/weightcache", "/var//lib/", "/var"])
def test_a_template_may_not_mount_the_root_itself(path: str) -> None:
    template = {"spec": {"containers": [{"name": "e", "image": "e:1"}],
                         "volumes": [{"name": "mine", "hostPath": {"path": path}}]}}
    with pytest.raises(SpecError) as refused:
        check_template_host_paths(engineset(template), CONFIG)
    assert refused.value.reason == "InvalidTemplate" and "compile caches" in refused.value.message
    template["spec"]["volumes"][0]["hostPath"]["path"] = "/var/lib/other"
    check_template_host_paths(engineset(template), CONFIG)


@pytest.mark.parametrize("root", ["/", "relative", "/run/weightcache/cc", "/models/cc", "/run", "/a/../b"])
def test_the_root_must_be_a_directory_of_its_own(root: str) -> None:
    with pytest.raises(ValueError):
        OperatorConfig(compile_cache_root=root).checked()


def test_chart_values_and_environment_reach_the_config() -> None:
    values = yaml.safe_load((CHART / "values.yaml").read_text())["compileCache"]
    assert values == {"enabled": CONFIG.compile_cache, "root": CONFIG.compile_cache_root}
    config = OperatorConfig.from_env({"WEIGHTCACHE_COMPILE_CACHE": "false",
                                      "WEIGHTCACHE_COMPILE_CACHE_ROOT": "/srv/compile"})
    assert (config.compile_cache, config.compile_cache_root) == (False, "/srv/compile")
    deployment = (CHART / "templates" / "deployment.yaml").read_text()
    assert "WEIGHTCACHE_COMPILE_CACHE" in deployment and "WEIGHTCACHE_COMPILE_CACHE_ROOT" in deployment


def prune(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "weightcache_agent.cli", "compile-cache-prune", *args],
                          capture_output=True, text=True, timeout=60)


def test_prune_removes_the_engine_sets_keys_and_never_follows_a_planted_link(tmp_path) -> None:
    """What the cleaner pod runs, on real files: the other keys go with --keep, everything without;
    a link an engine left inside its cache goes as a link, what it points to stays."""
    ns = tmp_path / "ml"
    old, new = ns / "chat" / "0123456789abcdef", ns / "chat" / "fedcba9876543210"
    (old / "vllm").mkdir(parents=True)
    (old / "vllm" / "artifact").write_bytes(b"x" * (3 << 20))
    new.mkdir()
    (new / "kernel").write_text("k")
    (ns / "other").mkdir()
    outside = tmp_path / "etc"
    outside.mkdir()
    (outside / "passwd").write_text("root")
    (old / "escape").symlink_to(outside, target_is_directory=True)
    (new / "escape").symlink_to(outside / "passwd")

    kept = prune(str(ns), "chat", "--keep", "fedcba9876543210")
    assert kept.returncode == 0, kept.stderr
    assert kept.stdout.splitlines() == ["removed chat/0123456789abcdef: 3.0 MiB"]
    assert not old.exists() and (new / "kernel").exists()

    whole = prune(str(ns), "chat")
    assert whole.returncode == 0 and whole.stdout.splitlines() == ["removed chat/fedcba9876543210: 0.0 MiB"]
    assert not (ns / "chat").exists() and (ns / "other").is_dir()
    assert (outside / "passwd").read_text() == "root"
    again = prune(str(ns), "chat")
    assert again.returncode == 0 and again.stdout.strip() == "nothing to remove under chat"


@pytest.mark.parametrize("args, says", [
    (("{ns}", "../etc"), "EngineSet name '../etc' is not a DNS label"),
    (("{ns}", "chat", "--keep", "../x"), "--keep '../x' is not an artifact key"),
    (("{ns}/missing", "chat"), "missing is not a directory"),
])
def test_prune_refuses_a_bad_call_in_one_line(tmp_path, args: tuple[str, ...], says: str) -> None:
    done = prune(*(a.format(ns=tmp_path) for a in args))
    assert done.returncode == 2 and says in done.stderr and len(done.stderr.strip().splitlines()) == 1, done.stderr
