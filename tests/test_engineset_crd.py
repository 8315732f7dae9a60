"""The EngineSet CRD: identity, scale subresource, printer columns, defaults, CEL, the example.

Admission is replayed as in tests/test_crd.py (the same helpers: structural
defaulting, ``jsonschema`` for the OpenAPI schema, ``celpy`` for every
``x-kubernetes-validations`` rule at its place), and the operator's own parser
(``api.v1alpha1.engineset_types.parse_engineset``) is held to the same verdicts.
"""
from __future__ import annotations

import copy
from typing import Any

import jsonschema
import pytest
import yaml
from operator_fixtures import CRD_PATH, example_documents
from test_crd import CEL, apply_defaults, cel_violations, schema_at, walk
from weightcache_operator.api.v1alpha1.engineset_types import parse_engineset
from weightcache_operator.api.v1alpha1.weightcache_types import SpecError

CRD = yaml.safe_load((CRD_PATH.parent / "weightcache.io_enginesets.yaml").read_text())
SCHEMA = CRD["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
TEMPLATE = {"spec": {"containers": [{"name": "engine", "image": "engine:1"}]}}


def es(spec: dict[str, Any], name: str = "chat") -> dict[str, Any]:
    return {"apiVersion": "weightcache.io/v1alpha1", "kind": "EngineSet",
            "metadata": {"name": name, "namespace": "default"}, "spec": copy.deepcopy(spec)}


def admit(doc: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    obj = apply_defaults(SCHEMA, copy.deepcopy(doc))
    errors = [e.message for e in jsonschema.Draft7Validator(SCHEMA).iter_errors(obj)]
    errors += [f"{p}: {m}" for p, m in cel_violations(SCHEMA, obj)]
    return obj, errors


def test_identity_scale_and_status_subresources() -> None:
    spec = CRD["spec"]
    assert CRD["metadata"]["name"] == "enginesets.weightcache.io"
    assert spec["group"] == "weightcache.io" and spec["scope"] == "Namespaced"
    assert spec["names"]["kind"] == "EngineSet" and spec["names"]["plural"] == "enginesets"
    assert spec["names"]["shortNames"] == ["wces"]
    (version,) = spec["versions"]
    assert version["name"] == "v1alpha1" and version["served"] and version["storage"]
    assert version["subresources"] == {"status": {}, "scale": {
        "specReplicasPath": ".spec.replicas", "statusReplicasPath": ".status.replicas",
        "labelSelectorPath": ".status.selector"}}


def test_printer_columns_point_at_fields_that_exist() -> None:
    (version,) = CRD["spec"]["versions"]
    columns = {c["name"]: c for c in version["additionalPrinterColumns"]}
    assert list(columns) == ["Ready", "Serving", "Standbys", "Status", "Cache", "Rollout", "Age"]
    assert columns["Status"]["jsonPath"] == '.status.conditions[?(@.type=="Ready")].reason'
    for column in columns.values():
        if column["name"] == "Age":
            continue
        assert schema_at(SCHEMA, column["jsonPath"])["type"] == column["type"], column


def test_every_list_is_bounded_and_every_rule_has_a_message() -> None:
    rules = 0
    for path, node in walk(SCHEMA):
        if node.get("type") == "array":
            assert "maxItems" in node, f"unbounded list at {path}"
        for rule in node.get("x-kubernetes-validations") or []:
            CEL.compile(rule["rule"])
            assert rule.get("message") and "\n" not in rule["message"]
            rules += 1
    assert rules >= 2
    # Only the template keeps unknown fields (it is a PodTemplateSpec of any shape).
    kept = [p for p, n in walk(SCHEMA) if n.get("x-kubernetes-preserve-unknown-fields")]
    assert kept and all(p[:2] == ("spec", "template") for p in kept), kept


def test_defaults_fill_a_minimal_spec() -> None:
    obj, errors = admit(es({"cacheRef": {"name": "llama"}, "template": TEMPLATE}))
    assert errors == []
    assert {k: v for k, v in obj["spec"].items() if k != "template"} == {
        "cacheRef": {"name": "llama"}, "replicas": 1, "standbys": 1, "drainSeconds": 30,
        "progressDeadlineSeconds": 600, "service": {"port": 8000}, "compileCache": {"enabled": True},
        "gpuBinding": {"mode": "dra", "deviceClassName": "gpu.nvidia.com", "runtimeClassName": "nvidia"},
    }
    # The operator reads the same defaults from a spec stored without them.
    parsed = parse_engineset("chat", {"cacheRef": {"name": "llama"}, "template": TEMPLATE})
    assert parsed == parse_engineset("chat", obj["spec"])
    assert (parsed.replicas, parsed.standbys, parsed.port, parsed.target_port, parsed.mode, parsed.device_class,
            parsed.runtime_class, parsed.drain_seconds, parsed.progress_deadline, parsed.service_name) == \
        (1, 1, 8000, 8000, "dra", "gpu.nvidia.com", "nvidia", 30, 600, "chat")


@pytest.mark.parametrize("spec, fragment, reason", [
    ({"cacheRef": {"name": "llama"}, "template": {"spec": {"containers": []}}},
     "at least one container", "InvalidTemplate"),
    ({"cacheRef": {"name": "llama"}, "template": {"metadata": {"labels": {"a": "b"}}}},
     "at least one container", "InvalidTemplate"),
], ids=["no-containers", "no-pod-spec"])
def test_cel_rejects_a_template_without_an_engine(spec: dict[str, Any], fragment: str, reason: str) -> None:
    _, errors = admit(es(spec))
    assert any(fragment in e and e.startswith(".spec.template:") for e in errors), errors
    with pytest.raises(SpecError) as e:
        parse_engineset("chat", spec)
    assert e.value.reason == reason


@pytest.mark.parametrize("name", ["Chat", "9chat", "chat.v2", "c" * 51])
def test_cel_rejects_names_that_cannot_name_the_service_and_pods(name: str) -> None:
    _, errors = admit(es({"cacheRef": {"name": "llama"}, "template": TEMPLATE}, name=name))
    assert any("DNS-1035 label of at most 50" in e for e in errors), errors
    with pytest.raises(SpecError) as e:
        parse_engineset(name, {"cacheRef": {"name": "llama"}, "template": TEMPLATE})
    assert e.value.reason == "InvalidName"


@pytest.mark.parametrize("change, fragment, reason", [
    ({"standbys": -1}, "minimum", "InvalidStandbys"),
    ({"standbys": 9}, "maximum", "InvalidStandbys"),
    ({"replicas": -1}, "minimum", "InvalidReplicas"),
    ({"gpuBinding": {"mode": "mig"}}, "is not one of", "InvalidGpuBinding"),
    ({"service": {"port": 0}}, "minimum", "InvalidSpec"),
    ({"cacheRef": {}}, "'name' is a required property", "InvalidCacheRef"),
])
def test_schema_and_operator_reject_bad_values(change: dict[str, Any], fragment: str, reason: str) -> None:
    spec = {"cacheRef": {"name": "llama"}, "template": TEMPLATE, **change}
    _, errors = admit(es(spec))
    assert any(fragment in e for e in errors), errors
    with pytest.raises(SpecError) as e:
        parse_engineset("chat", spec)
    assert e.value.reason == reason


def test_standbys_zero_and_scale_to_zero_are_valid() -> None:
    spec = {"cacheRef": {"name": "llama"}, "template": TEMPLATE, "standbys": 0, "replicas": 0,
            "gpuBinding": {"mode": "visibleDevices"}}
    obj, errors = admit(es(spec))
    assert errors == []
    parsed = parse_engineset("chat", obj["spec"])
    assert parsed.slots == 1 and parsed.replicas == 0 and parsed.mode == "visibleDevices"


def test_example_is_admitted_and_parsed() -> None:
    docs = [(p, d) for p, d in example_documents() if d["kind"] == "EngineSet"]
    assert [p.name for p, _ in docs] == ["engineset-chat.yaml", "engineset-sglang.yaml", "engineset-vllm.yaml"]
    caches = {d["metadata"]["name"] for _, d in example_documents() if d["kind"] == "WeightCache"}
    for path, doc in docs:
        obj, errors = admit(doc)
        assert errors == [], (path.name, errors)
        parsed = parse_engineset(doc["metadata"]["name"], obj["spec"])
        assert parsed.replicas == 2 and parsed.standbys == 1
        assert parsed.cache_name in caches  # the cache it names is an example too
