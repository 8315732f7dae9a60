"""Fixtures for the bind tests: each test once per bind path, and what "nothing swapped" means.
Import them into a test module by name."""
from __future__ import annotations

import pytest
from torch import nn

from weightcache_agent.client.rebind import _bindfast


@pytest.fixture(params=[True, False], ids=["C", "python"])
def native(request) -> bool:
    """Each test once with the C extension, once with the pure-Python path."""
    if request.param and _bindfast is None:
        pytest.skip("C extension not built")
    return request.param


def nothing_swapped(m: nn.Module) -> bool:
    return all(t.is_meta for t in m.state_dict(keep_vars=True).values())
