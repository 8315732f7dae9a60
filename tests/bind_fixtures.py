"""Fixtures for the bind tests: each test once per bind path, and what "nothing swapped" means.
Import them into a test module by name."""
from __future__ import annotations

import pytest
from torch import nn

from weightcache_agent.client import rebind
from weightcache_agent.client.rebind import _bindfast


@pytest.fixture(params=["C++", "C", "python"])
def native(request, monkeypatch) -> bool:
    """Each test once per bind path: C with the torch-native row binder (conftest's `torch_rows`),
    C alone, pure Python. Returns `bind_manifest`'s `native` flag."""
    if request.param != "python" and _bindfast is None:
        pytest.skip("C extension not built")
    monkeypatch.setattr(rebind, "_torch_rows", request.getfixturevalue("torch_rows") if request.param == "C++" else None)
    return request.param != "python"


def nothing_swapped(m: nn.Module) -> bool:
    return all(t.is_meta for t in m.state_dict(keep_vars=True).values())
