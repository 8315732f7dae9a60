"""Manifest builders: field by field, and against the Kubernetes OpenAPI schemas.

``kubernetes-validate`` checks each rendered object strictly (no unknown fields)
against the schemas of the oldest supported Kubernetes (1.28) and the newest it ships.
"""
from __future__ import annotations

import copy
from typing import Any

import kubernetes_validate
import pytest
import yaml

from operator_fixtures import LLAMA_SPEC
from weightcache_operator.api.v1alpha1.weightcache_types import SpecError, parse_spec
from weightcache_operator.config import OperatorConfig
from weightcache_operator.controller.weightcache.manifests import (
    ANNOTATION_SHARDING_HASH,
    ANNOTATION_SPEC_HASH,
    agent_args,
    render_daemonset,
    SocketPathTooLong,
    render_sharding_configmap,
    socket_dir,
)
from weightcache_operator.kube import merge_patch_for

K8S_VERSIONS = ("1.28.0", kubernetes_validate.utils.latest_version())
# The specs below name their own agent image: one the admin allows.
CONFIG = OperatorConfig(agent_allowed_images=("registry.local/agent:dev",))

RULES_SPEC: dict[str, Any] = {
    "model": {"pvc": "qwen-weights", "revision": "v1"},
    "parallelism": {"tensor": 2, "expert": 2},
    "sharding": {"rules": [{"pattern": r".*\.q_proj\.weight$", "mode": "column"},
                           {"pattern": r".*experts.*", "mode": "column", "dim": 0}]},
    "nodeSelector": {"pool": "gpu"},
    "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"},
                    {"key": "dedicated", "operator": "Equal", "value": "llm", "effect": "NoExecute",
                     "tolerationSeconds": 60}],
    "gpusPerNode": 4,
    "agent": {"image": "registry.local/agent:dev",
              "resources": {"requests": {"cpu": "4", "memory": "32Gi"}, "limits": {"memory": "64Gi"}}},
}


def render(spec: dict[str, Any], config: OperatorConfig = CONFIG, name: str = "llama") -> dict[str, Any]:
    return render_daemonset(parse_spec(spec), "ml", name, config)


def pod_spec(ds: dict[str, Any]) -> dict[str, Any]:
    return ds["spec"]["template"]["spec"]


def container(ds: dict[str, Any]) -> dict[str, Any]:
    (c,) = pod_spec(ds)["containers"]
    return c


@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize("spec", [LLAMA_SPEC, RULES_SPEC], ids=["hostpath", "pvc-rules"])
def test_rendered_objects_validate_against_kubernetes_schemas(spec: dict[str, Any], version: str) -> None:
    cs = parse_spec(spec)
    for config in (CONFIG, CONFIG.replace(agent_privileged=False, priority_class="", runtime_class="nvidia",
                                          agent_image_pull_secrets=("regcred",))):
        kubernetes_validate.validate(render_daemonset(cs, "ml", "llama", config), version, strict=True)
    cm = render_sharding_configmap(cs, "ml", "llama")
    if cm is not None:
        kubernetes_validate.validate(cm, version, strict=True)


def test_schema_validation_catches_a_broken_manifest() -> None:
    """The validation above has teeth."""
    ds = render(LLAMA_SPEC)
    container(ds)["securityContext"]["privileged"] = "yes"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(ds, K8S_VERSIONS[0], strict=True)


def test_agent_command_line_contract() -> None:
    ds = render(LLAMA_SPEC)
    assert container(ds)["command"] == ["weightcache"]
    assert container(ds)["args"] == [
        "agent",
        "--model", "/models/meta-llama/Llama-3.1-70B-Instruct",
        "--socket-dir", "/run/weightcache/ml.llama.st632gbxo2i5h6kdqs66qpid",
        "--cache=ml/llama",
        "--tp-size", "8",
        "--devices", "all",
        "--quantization", "fp8-block",
        "--dtype", "bfloat16",
        "--backend", "auto",
        "--http-port", "9464",
        "--revision=main",
        "--sharding", "llama",
    ]
    args = agent_args(parse_spec(RULES_SPEC), "ml", "qwen")
    assert args[args.index("--model") + 1] == "/models"
    assert args[args.index("--sharding") + 1] == "/etc/weightcache/sharding.yaml"
    assert args[-1] == "--expert-parallel"
    assert not any(a.startswith("--revision") for a in agent_args(parse_spec({"model": {"path": "m"}}), "ml", "x"))
    # the deprecated layout field changes nothing: every arena serves fused and checkpoint names
    assert agent_args(parse_spec({"model": {"path": "m"}, "layout": "vllm"}), "ml", "x") == \
        agent_args(parse_spec({"model": {"path": "m"}}), "ml", "x")
    assert "--layout" not in agent_args(parse_spec({"model": {"path": "m"}, "layout": "vllm"}), "ml", "x")


def test_daemonset_runs_privileged_agents_on_every_gpu_node() -> None:
    ds = render(LLAMA_SPEC)
    assert ds["metadata"]["name"] == "llama-agent" and ds["metadata"]["namespace"] == "ml"
    c, ps = container(ds), pod_spec(ds)
    assert c["securityContext"] == {"privileged": True}
    env = {e["name"]: e for e in c["env"]}
    assert env["NVIDIA_VISIBLE_DEVICES"]["value"] == "all"
    assert env["NODE_NAME"]["valueFrom"] == {"fieldRef": {"fieldPath": "spec.nodeName"}}
    assert "resources" not in c  # no nvidia.com/gpu request: engines keep the GPUs
    assert ps["tolerations"] == [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
    assert ps["priorityClassName"] == "system-node-critical"
    # The agents run as the namespace's weightcache-agent account (its token: the failover label write).
    assert ps["serviceAccountName"] == "weightcache-agent"
    assert ps["automountServiceAccountToken"] is True
    assert "hostNetwork" not in ps and "hostPID" not in ps and "hostIPC" not in ps
    volumes = {v["name"]: v for v in ps["volumes"]}
    assert volumes["sockets"]["hostPath"] == {"path": "/run/weightcache/ml.llama.st632gbxo2i5h6kdqs66qpid", "type": "DirectoryOrCreate"}
    assert volumes["models"]["hostPath"] == {"path": "/models", "type": "Directory"}
    mounts = {m["name"]: m for m in c["volumeMounts"]}
    assert mounts["sockets"]["mountPath"] == "/run/weightcache/ml.llama.st632gbxo2i5h6kdqs66qpid"
    assert mounts["models"]["readOnly"] is True and mounts["models"]["mountPath"] == "/models"
    assert ds["spec"]["selector"]["matchLabels"] == {
        "app.kubernetes.io/name": "weightcache-agent", "weightcache.io/cache": "llama"}
    labels = ds["spec"]["template"]["metadata"]["labels"]
    assert ds["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert ds["spec"]["updateStrategy"] == {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 1}}


def test_probes_use_the_agent_http_endpoints_with_generous_timing() -> None:
    c = container(render(LLAMA_SPEC))
    assert c["ports"] == [{"name": "http", "containerPort": 9464, "protocol": "TCP"}]
    assert c["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert c["startupProbe"]["httpGet"]["path"] == "/healthz"
    assert c["readinessProbe"]["httpGet"]["path"] == "/readyz"
    startup = c["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 300
    # Liveness never looks at /readyz: a minutes-long cold load must not restart the agent.
    assert all(p["httpGet"]["port"] == "http" for p in (c["livenessProbe"], c["readinessProbe"], startup))


def test_pvc_rules_selector_tolerations_resources_and_image() -> None:
    ds = render(RULES_SPEC, name="qwen")
    c, ps = container(ds), pod_spec(ds)
    volumes = {v["name"]: v for v in ps["volumes"]}
    assert volumes["models"] == {"name": "models",
                                 "persistentVolumeClaim": {"claimName": "qwen-weights", "readOnly": True}}
    assert volumes["sharding"]["configMap"]["name"] == "qwen-sharding"
    assert {"name": "sharding", "mountPath": "/etc/weightcache", "readOnly": True} in c["volumeMounts"]
    assert ANNOTATION_SHARDING_HASH in ds["spec"]["template"]["metadata"]["annotations"]
    assert ps["nodeSelector"] == {"pool": "gpu"}
    # The GPU toleration is not duplicated when the spec repeats it.
    assert ps["tolerations"] == [
        {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"},
        {"key": "dedicated", "operator": "Equal", "value": "llm", "effect": "NoExecute", "tolerationSeconds": 60},
    ]
    assert ps["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"] == [
        {"matchExpressions": [{"key": "nvidia.com/gpu.count", "operator": "Gt", "values": ["3"]}]}]
    assert c["resources"] == {"requests": {"cpu": "4", "memory": "32Gi"}, "limits": {"memory": "64Gi"}}
    assert c["image"] == "registry.local/agent:dev"
    assert container(render(LLAMA_SPEC))["image"] == CONFIG.agent_image

    cm = render_sharding_configmap(parse_spec(RULES_SPEC), "ml", "qwen")
    assert cm["metadata"]["name"] == "qwen-sharding"
    assert yaml.safe_load(cm["data"]["sharding.yaml"]) == {"rules": RULES_SPEC["sharding"]["rules"]}
    assert render_sharding_configmap(parse_spec(LLAMA_SPEC), "ml", "llama") is None
    # Rules on top of a preset: the file names the preset, the agent puts the rules first.
    both = parse_spec({**LLAMA_SPEC, "sharding": {"preset": "llama", "rules": [{"pattern": "lm_head", "mode": "vocab"}]}})
    assert yaml.safe_load(render_sharding_configmap(both, "ml", "llama")["data"]["sharding.yaml"]) == {
        "preset": "llama", "rules": [{"pattern": "lm_head", "mode": "vocab"}]}
    assert agent_args(both, "ml", "llama")[-2:] == ["--sharding", "/etc/weightcache/sharding.yaml"]


def test_operator_settings_shape_the_pods() -> None:
    config = CONFIG.replace(agent_privileged=False, priority_class="", model_root="/data/models",
                            runtime_class="nvidia", agent_image="agent:2", agent_image_pull_policy="Always",
                            agent_image_pull_secrets=("regcred",))
    ds = render(LLAMA_SPEC, config)
    c, ps = container(ds), pod_spec(ds)
    assert c["securityContext"] == {"privileged": False, "allowPrivilegeEscalation": False}
    assert "priorityClassName" not in ps
    assert ps["runtimeClassName"] == "nvidia"
    assert ps["imagePullSecrets"] == [{"name": "regcred"}]
    assert c["image"] == "agent:2" and c["imagePullPolicy"] == "Always"
    assert {v["name"]: v for v in ps["volumes"]}["models"]["hostPath"]["path"] == "/data/models"




def test_a_weightcache_may_name_only_an_agent_image_the_admin_allows() -> None:
    """Agents run privileged with host paths: a namespaced object never picks their image."""
    cs = parse_spec(RULES_SPEC)  # names registry.local/agent:dev
    with pytest.raises(SpecError) as refused:
        render_daemonset(cs, "ml", "llama", OperatorConfig())
    assert refused.value.reason == "AgentImageNotAllowed"
    assert refused.value.message.startswith("agent.image 'registry.local/agent:dev' is not an image the cluster admin "
                                            "allows for agents (allowed: ghcr.io/weightcache/agent:0.1.0;")
    assert container(render_daemonset(cs, "ml", "llama", CONFIG))["image"] == "registry.local/agent:dev"
    env = OperatorConfig.from_env({"WEIGHTCACHE_AGENT_ALLOWED_IMAGES": "a:1, registry.local/agent:dev",
                                   "WEIGHTCACHE_AGENT_LABEL_PODS": "off"})
    assert env.agent_allowed_images == ("a:1", "registry.local/agent:dev")
    ds = render_daemonset(cs, "ml", "llama", env)
    assert container(ds)["image"] == "registry.local/agent:dev"
    # Where no admission policy bounds the agents' write, they do not label pods at all.
    assert container(ds)["args"][-2:] == ["--label-pods", "off"]
    assert "--label-pods" not in container(render_daemonset(cs, "ml", "llama", CONFIG))["args"]
    with pytest.raises(ValueError, match="label-pods must be auto or off"):
        OperatorConfig(agent_label_pods="on").checked()

def test_agents_bind_the_pod_ip_and_take_the_socket_group() -> None:
    env = {e["name"]: e for e in container(render(LLAMA_SPEC, CONFIG))["env"]}
    assert env["POD_IP"]["valueFrom"] == {"fieldRef": {"fieldPath": "status.podIP"}}
    assert "WEIGHTCACHE_SOCKET_GROUP" not in env  # default: root engines only
    grouped = {e["name"]: e for e in container(render(LLAMA_SPEC, CONFIG.replace(agent_socket_group="2000")))["env"]}
    assert grouped["WEIGHTCACHE_SOCKET_GROUP"]["value"] == "2000"
    assert OperatorConfig.from_env({"WEIGHTCACHE_AGENT_SOCKET_GROUP": " engines "}).agent_socket_group == "engines"


def test_spec_hash_changes_exactly_when_the_rendering_does() -> None:
    a = render(LLAMA_SPEC)
    reordered = dict(reversed(list(copy.deepcopy(LLAMA_SPEC).items())))
    assert render(reordered) == a  # key order in the spec does not matter
    assert render({**LLAMA_SPEC, "model": {"path": "meta-llama//Llama-3.1-70B-Instruct/", "revision": "main"}}) == a
    h = a["metadata"]["annotations"][ANNOTATION_SPEC_HASH]
    for change in ({"quantization": "none"}, {"dtype": "float16"}, {"nodeSelector": {"a": "b"}},
                   {"model": {"path": "other"}}):
        assert render({**LLAMA_SPEC, **change})["metadata"]["annotations"][ANNOTATION_SPEC_HASH] != h
    rules2 = copy.deepcopy(RULES_SPEC)
    rules2["sharding"]["rules"][0]["mode"] = "row"
    assert render(rules2)["metadata"]["annotations"][ANNOTATION_SPEC_HASH] != \
        render(RULES_SPEC)["metadata"]["annotations"][ANNOTATION_SPEC_HASH]


def test_merge_patch_removes_what_the_desired_object_lacks() -> None:
    current = {"template": {"spec": {"nodeSelector": {"a": "1", "b": "2"}, "dnsPolicy": "ClusterFirst",
                                     "tolerations": [{"key": "x"}, {"key": "y"}]}}, "revisionHistoryLimit": 10}
    desired = {"template": {"spec": {"nodeSelector": {"a": "1"}, "tolerations": [{"key": "x"}]}},
               "revisionHistoryLimit": 10}
    patch = merge_patch_for(current, desired)
    assert patch == {"template": {"spec": {"nodeSelector": {"b": None}, "dnsPolicy": None,
                                           "tolerations": [{"key": "x"}]}}}
    assert merge_patch_for(desired, desired) == {}


def test_config_from_env_matches_chart_names() -> None:
    env = {
        "WEIGHTCACHE_AGENT_IMAGE": "agent:9",
        "WEIGHTCACHE_AGENT_PRIVILEGED": "false",
        "WEIGHTCACHE_PRIORITY_CLASS": "",
        "WEIGHTCACHE_MODEL_ROOT": "/mnt/models",
        "WEIGHTCACHE_RUNTIME_CLASS": "nvidia",
        "WEIGHTCACHE_AGENT_IMAGE_PULL_SECRETS": "a, b",
        "WEIGHTCACHE_POLL_INTERVAL": "10",
    }
    config = OperatorConfig.from_env(env)
    assert (config.agent_image, config.agent_privileged, config.priority_class, config.model_root,
            config.runtime_class, config.agent_image_pull_secrets, config.poll_interval) == \
        ("agent:9", False, "", "/mnt/models", "nvidia", ("a", "b"), 10.0)
    assert OperatorConfig.from_env({}) == OperatorConfig()
    with pytest.raises(ValueError):
        OperatorConfig.from_env({"WEIGHTCACHE_MODEL_ROOT": "relative/path"})
    with pytest.raises(ValueError):
        OperatorConfig.from_env({"WEIGHTCACHE_AGENT_PRIVILEGED": "maybe"})
    with pytest.raises(ValueError, match=r"^\$WEIGHTCACHE_POLL_INTERVAL='ten' is not a number of seconds$"):
        OperatorConfig.from_env({"WEIGHTCACHE_POLL_INTERVAL": "ten"})


def test_socket_paths_fit_a_unix_socket_address_whatever_the_names() -> None:
    longest = socket_dir("n" * 63, "x" * 253)  # the longest namespace and object name Kubernetes allows
    assert len(f"{longest}/GPU-{'0' * 8}-{'0' * 4}-{'0' * 4}-{'0' * 4}-{'0' * 12}.sock") <= 107
    assert longest.startswith("/run/weightcache/nnnnnnnn.xxxxxxxxxx.")
    # Cut names alike, caches apart: the hash of the full pair tells them apart.
    assert socket_dir("team", "llama-3-70b-instruct-a") != socket_dir("team", "llama-3-70b-instruct-b")
    assert socket_dir("a.b", "c") != socket_dir("a", "b.c")
    with pytest.raises(SocketPathTooLong, match="at most 107 bytes"):
        socket_dir("ml", "llama", root="/var/lib/" + "k" * 50)
