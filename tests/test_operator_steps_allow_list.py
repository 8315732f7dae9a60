"""One quantization allow-list: the agent's, which the CRD and the operator must repeat exactly.

The agent (``weightcache_agent.quantization``) decides which methods can be served from
shared tensors. The CRD repeats the list for ``kubectl apply`` (its enum, and the CEL
rule naming the refused methods), and the operator takes it from the agent. A method
added to or dropped from one and not the others fails here.
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from weightcache_agent import quantization
from weightcache_agent.errors import UnsupportedQuantization
from weightcache_operator.api.v1alpha1.weightcache_types import (
    REFUSED_QUANTIZATION,
    SUPPORTED_QUANTIZATION,
    SpecError,
    check_quantization,
)

ROOT = Path(__file__).resolve().parent.parent


def quantization_schemas() -> list[tuple[Path, dict[str, Any]]]:
    """Every ``spec.quantization`` schema in the CRDs under crds/."""
    found = []
    for path in sorted((ROOT / "crds").glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            for version in ((doc or {}).get("spec") or {}).get("versions") or []:
                spec = version["schema"]["openAPIV3Schema"]["properties"].get("spec") or {}
                if "quantization" in (spec.get("properties") or {}):
                    found.append((path, spec["properties"]["quantization"]))
    return found


SCHEMAS = quantization_schemas()


def test_a_crd_has_the_field() -> None:
    assert SCHEMAS, "no CRD under crds/ has spec.quantization"


@pytest.mark.parametrize("path, schema", SCHEMAS, ids=lambda x: x.name if isinstance(x, Path) else "")
def test_the_crd_allows_exactly_what_the_agent_allows(path: Path, schema: dict[str, Any]) -> None:
    assert schema["enum"] == list(quantization.ALLOWED), f"{path.name}: enum is not the agent's ALLOWED"
    assert schema["default"] in quantization.ALLOWED


@pytest.mark.parametrize("path, schema", SCHEMAS, ids=lambda x: x.name if isinstance(x, Path) else "")
def test_the_crd_refuses_what_the_agent_refuses_for_a_named_reason(path: Path, schema: dict[str, Any]) -> None:
    rules = [r["rule"] for r in schema.get("x-kubernetes-validations") or [] if "self in [" in r["rule"]]
    assert len(rules) == 1, f"{path.name}: expected one CEL rule listing the refused methods"
    refused = re.findall(r"'([^']+)'", re.search(r"\[(.*)\]", rules[0]).group(1))
    assert tuple(refused) == REFUSED_QUANTIZATION
    assert not set(refused) & set(quantization.ALLOWED)
    for method in refused:
        with pytest.raises(UnsupportedQuantization) as e:
            quantization.check_quantization(method)
        # A reason of its own, not the catch-all for methods the agent has never heard of.
        assert "is refused" in str(e.value) and "not on the allowlist" not in str(e.value), method
    # The sentence that ends the CEL messages points at the allowed methods.
    for rule in schema["x-kubernetes-validations"]:
        assert f"use {' or '.join(quantization.ALLOWED)}." in rule["message"]


def test_the_operator_takes_the_agents_list() -> None:
    assert SUPPORTED_QUANTIZATION == quantization.ALLOWED
    for method in quantization.ALLOWED:
        assert check_quantization(method) == method
    with pytest.raises(SpecError) as e:
        check_quantization("int3")
    assert e.value.reason == "UnknownQuantization"
