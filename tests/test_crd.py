"""The WeightCache CRD: structure, defaults, printer columns, CEL rules, examples.

What the API server does at ``kubectl apply`` time is replayed here with libraries:
the OpenAPI schema with ``jsonschema``, defaulting with a small structural walker
(the same rule as the API server: a missing property with a default gets it, also
inside defaulted objects), and every ``x-kubernetes-validations`` rule compiled and
evaluated with ``celpy`` (cel-python) at its place in the object. The operator's own
spec check (``weightcache_operator.api.v1alpha1.weightcache_types``) is held to the same verdicts.
"""
from __future__ import annotations

import copy
import re
from collections.abc import Iterator
from typing import Any

import celpy
import jsonschema
import pytest

from operator_fixtures import LLAMA_SPEC, crd_schema, example_documents, load_crd, weightcache
from weightcache_operator.api.v1alpha1.weightcache_types import (
    REFUSED_QUANTIZATION,
    REFUSED_WHY,
    SpecError,
    parse_spec,
)

SCHEMA = crd_schema()
CEL = celpy.Environment()


# --- helpers replaying the API server ----------------------------------------------

def walk(schema: dict[str, Any], path: tuple[str, ...] = ()) -> Iterator[tuple[tuple[str, ...], dict[str, Any]]]:
    yield path, schema
    for name, sub in (schema.get("properties") or {}).items():
        yield from walk(sub, path + (name,))
    if isinstance(schema.get("items"), dict):
        yield from walk(schema["items"], path + ("[]",))
    if isinstance(schema.get("additionalProperties"), dict):
        yield from walk(schema["additionalProperties"], path + ("{}",))


def apply_defaults(schema: dict[str, Any], value: Any) -> Any:
    """Structural defaulting as the API server does it (recursively, also into defaults)."""
    if isinstance(value, dict):
        for name, sub in (schema.get("properties") or {}).items():
            if name not in value and "default" in sub:
                value[name] = copy.deepcopy(sub["default"])
            if name in value:
                value[name] = apply_defaults(sub, value[name])
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        value[:] = [apply_defaults(schema["items"], v) for v in value]
    return value


def cel_eval(expr: str, value: Any) -> Any:
    return CEL.program(CEL.compile(expr)).evaluate({"self": celpy.json_to_cel(value)})


def cel_violations(schema: dict[str, Any], value: Any, path: str = "") -> list[tuple[str, str]]:
    """Evaluate every rule where the value exists; return (path, message) of each failing one."""
    out: list[tuple[str, str]] = []
    for rule in schema.get("x-kubernetes-validations") or []:
        if not bool(cel_eval(rule["rule"], value)):
            message = rule.get("message") or f"failed rule: {rule['rule']}"
            if "messageExpression" in rule:
                message = str(cel_eval(rule["messageExpression"], value))
            out.append((path or ".", message))
    if isinstance(value, dict):
        for name, sub in (schema.get("properties") or {}).items():
            if name in value:
                out += cel_violations(sub, value[name], f"{path}.{name}")
        if isinstance(schema.get("additionalProperties"), dict):
            for name, v in value.items():
                out += cel_violations(schema["additionalProperties"], v, f"{path}.{name}")
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        for i, v in enumerate(value):
            out += cel_violations(schema["items"], v, f"{path}[{i}]")
    return out


def admit(doc: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """Default, then validate (schema + CEL) like the API server; return (object, errors)."""
    obj = apply_defaults(SCHEMA, copy.deepcopy(doc))
    errors = [e.message for e in jsonschema.Draft7Validator(SCHEMA).iter_errors(obj)]
    errors += [f"{p}: {m}" for p, m in cel_violations(SCHEMA, obj)]
    return obj, errors


def wc(spec: dict[str, Any], name: str = "test") -> dict[str, Any]:
    doc = weightcache(name, spec)
    for key in ("uid", "generation", "resourceVersion"):
        doc["metadata"].pop(key)
    return doc


# --- structure ----------------------------------------------------------------------

def test_crd_identity_and_subresources() -> None:
    crd = load_crd()
    assert crd["apiVersion"] == "apiextensions.k8s.io/v1" and crd["kind"] == "CustomResourceDefinition"
    spec = crd["spec"]
    assert crd["metadata"]["name"] == "weightcaches.weightcache.io"
    assert spec["group"] == "weightcache.io" and spec["scope"] == "Namespaced"
    assert spec["names"]["kind"] == "WeightCache" and spec["names"]["shortNames"] == ["wc"]
    (version,) = spec["versions"]
    assert version["name"] == "v1alpha1" and version["served"] and version["storage"]
    assert version["subresources"] == {"status": {}}


def test_schema_is_structural() -> None:
    """Every node has a type (or is int-or-string); no preserve-unknown escape hatches."""
    for path, node in walk(SCHEMA):
        if path == ("metadata",):
            continue
        assert "type" in node or node.get("x-kubernetes-int-or-string"), f"no type at {path}"
        assert not node.get("x-kubernetes-preserve-unknown-fields"), f"unknown fields kept at {path}"
        if node.get("type") == "array":
            assert "maxItems" in node, f"unbounded list at {path} (CEL cost and object size)"


def test_spec_paths_are_the_contract() -> None:
    props = SCHEMA["properties"]["spec"]["properties"]
    assert set(props) == {"model", "parallelism", "quantization", "dtype", "layout", "sharding", "nodeSelector",
                          "tolerations", "gpusPerNode", "agent"}
    assert props["layout"]["enum"] == ["file", "vllm"] and "default" not in props["layout"]  # deprecated, ignored
    assert set(props["model"]["properties"]) == {"path", "pvc", "revision"}
    assert set(props["parallelism"]["properties"]) == {"tensor", "pipeline", "data", "expert"}
    assert set(props["agent"]["properties"]) == {"resources", "image"}
    assert props["quantization"]["enum"] == ["none", "fp8-block"]
    status = SCHEMA["properties"]["status"]["properties"]
    assert {"conditions", "observedGeneration", "readyNodes", "desiredNodes", "nodes", "nodeCounts",
            "nodesOmitted", "daemonSet", "socketDir"} <= set(status)
    node = status["nodes"]["items"]["properties"]
    assert {"phase", "bytes", "loadSeconds", "clients", "gpuUUIDs", "socketDir", "fingerprint"} <= set(node)
    assert status["nodes"]["maxItems"] == 32
    cond = status["conditions"]["items"]
    assert set(cond["required"]) == {"type", "status", "lastTransitionTime", "reason", "message"}
    assert "observedGeneration" in cond["properties"]


def test_printer_columns() -> None:
    (version,) = load_crd()["spec"]["versions"]
    columns = {c["name"].upper(): c for c in version["additionalPrinterColumns"]}
    assert list(columns) == ["READY", "NODES", "STATUS", "MODEL", "QUANT", "AGE"]
    assert columns["READY"]["jsonPath"] == ".status.readyNodes"
    assert columns["NODES"]["jsonPath"] == ".status.desiredNodes"
    assert columns["STATUS"]["jsonPath"] == '.status.conditions[?(@.type=="Ready")].reason'
    assert columns["MODEL"]["jsonPath"] == ".status.model"
    assert columns["QUANT"]["jsonPath"] == ".spec.quantization"
    assert columns["AGE"] == {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"}
    # Every column points at a field the schema has.
    for column in columns.values():
        if column["jsonPath"].startswith(".metadata"):
            continue
        assert schema_at(SCHEMA, column["jsonPath"])["type"] == column["type"], column


def schema_at(schema: dict, json_path: str) -> dict:
    """The schema node a printer column's JSONPath reads (a filter `[?(...)]` selects list items)."""
    node = schema
    for name, selected in re.findall(r"\.(\w+)(\[\?\(.*?\)\])?", json_path):
        node = node["properties"][name]
        if selected:
            node = node["items"]
    return node


def test_defaults_fill_a_minimal_spec() -> None:
    obj, errors = admit(wc({"model": {"path": "m"}}))
    assert errors == []
    assert obj["spec"] == {
        "model": {"path": "m"},
        "parallelism": {"tensor": 1, "pipeline": 1, "data": 1, "expert": 1},
        "quantization": "none",
        "dtype": "auto",
    }


# --- CEL ------------------------------------------------------------------------------

def test_every_rule_compiles_and_has_a_message() -> None:
    rules = [(p, r) for p, node in walk(SCHEMA) for r in node.get("x-kubernetes-validations") or []]
    assert len(rules) >= 6
    for path, rule in rules:
        CEL.compile(rule["rule"])
        assert rule.get("message"), f"rule at {path} has no message"
        assert "\n" not in rule["message"]
        if "messageExpression" in rule:
            CEL.compile(rule["messageExpression"])


@pytest.mark.parametrize("method", REFUSED_QUANTIZATION)
def test_refused_quantization_is_rejected_with_the_reason(method: str) -> None:
    _, errors = admit(wc({**LLAMA_SPEC, "quantization": method}))
    cel = [e for e in errors if e.startswith(".spec.quantization:")]
    assert cel == [f".spec.quantization: quantization {method} is refused: {REFUSED_WHY}"]
    # The static message (shown where messageExpression is unsupported) says why too.
    rule = SCHEMA["properties"]["spec"]["properties"]["quantization"]["x-kubernetes-validations"][0]
    assert REFUSED_WHY in rule["message"]
    # The operator refuses it with the same words.
    with pytest.raises(SpecError) as e:
        parse_spec({**LLAMA_SPEC, "quantization": method})
    assert e.value.reason == "RefusedQuantization" and REFUSED_WHY in e.value.message


@pytest.mark.parametrize("spec, fragment", [
    ({"model": {"path": "m", "pvc": "claim"}}, "exactly one of model.path or model.pvc"),
    ({"model": {"revision": "r"}}, "exactly one of model.path or model.pvc"),
    ({"model": {"path": "/abs/m"}}, "must be relative to the node's model root"),
    ({"model": {"path": "a/../../etc"}}, "must not contain '..'"),
    ({"model": {"path": "m"}, "parallelism": {"tensor": 0}}, "positive number of GPUs"),
    ({"model": {"path": "m"}, "parallelism": {"tensor": -2}}, "positive number of GPUs"),
    ({"model": {"path": "m"}, "parallelism": {"tensor": 8}, "gpusPerNode": 4}, "must not exceed gpusPerNode"),
])
def test_cel_rules_reject_with_a_message(spec: dict[str, Any], fragment: str) -> None:
    _, errors = admit(wc(spec))
    assert any(fragment in e for e in errors), errors
    # The operator reaches the same verdict for objects that skipped validation.
    with pytest.raises(SpecError):
        parse_spec(spec)


def test_long_names_are_rejected() -> None:
    _, errors = admit(wc({"model": {"path": "m"}}, name="x" * 64))
    assert any("at most 63 characters" in e for e in errors)
    _, errors = admit(wc({"model": {"path": "m"}}, name="x" * 63))
    assert errors == []


@pytest.mark.parametrize("spec", [
    {"model": {"path": "a..b/c"}},  # dots inside a name are fine
    {"model": {"pvc": "weights", "revision": "v2"}, "parallelism": {"tensor": 4, "expert": 4}},
    {"model": {"path": "m"}, "parallelism": {"tensor": 8}, "gpusPerNode": 8},
    {"model": {"path": "m"}, "agent": {"resources": {"limits": {"memory": "64Gi", "cpu": 4}}}},
    {"model": {"path": "m"}, "sharding": {"preset": "llama", "rules": [{"pattern": "lm_head", "mode": "vocab"}]}},
])
def test_valid_specs_pass_schema_cel_and_operator(spec: dict[str, Any]) -> None:
    obj, errors = admit(wc(spec))
    assert errors == []
    parse_spec(obj["spec"])


@pytest.mark.parametrize("spec, fragment", [
    ({"model": {"path": "m"}, "quantization": "int4"}, "is not one of"),
    ({"model": {"path": "m"}, "dtype": "fp64"}, "is not one of"),
    ({"model": {"pvc": "Not_A_Claim"}}, "does not match"),
    ({"model": {"path": "m"}, "parallelism": {"tensor": 65}}, "maximum"),
    ({"model": {"path": "m"}, "agent": {"resources": {"limits": {"memory": "lots"}}}}, "does not match"),
    ({"model": {"path": "m"}, "sharding": {"rules": [{"pattern": "x", "mode": "diagonal"}]}}, "is not one of"),
])
def test_schema_rejects_bad_values(spec: dict[str, Any], fragment: str) -> None:
    _, errors = admit(wc(spec))
    assert any(fragment in e for e in errors), errors


def test_unknown_quantization_is_refused_by_the_operator_too() -> None:
    with pytest.raises(SpecError) as e:
        parse_spec({"model": {"path": "m"}, "quantization": "int4"})
    assert e.value.reason == "UnknownQuantization"


# --- examples -------------------------------------------------------------------------

def test_examples_are_admitted() -> None:
    docs = [(p, d) for p, d in example_documents() if d["kind"] == "WeightCache"]
    assert len(docs) >= 2
    for path, doc in docs:
        obj, errors = admit(doc)
        assert errors == [], (path.name, errors)
        parse_spec(obj["spec"])


def test_llama_example_is_tp8_fp8_block() -> None:
    (doc,) = [d for p, d in example_documents() if p.name == "llama-70b-tp8-fp8.yaml"]
    assert doc["spec"]["parallelism"]["tensor"] == 8
    assert doc["spec"]["quantization"] == "fp8-block"
