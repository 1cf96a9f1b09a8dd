"""The integration tier: real Ray clusters, real torch_xla and JAX, real processes."""

from __future__ import annotations

import pytest


def pytest_collection_modifyitems(config, items):
    for item in items:
        if "/tests/integration/" in str(item.fspath):
            item.add_marker(pytest.mark.integration)
    # A host whose agent or node a test replaces has a new agent, and a new agent has no spares: the
    # tests after it would start their hosts cold. They run last of all. (A stable sort: pytest's
    # order otherwise.)
    items.sort(key=lambda i: i.get_closest_marker("replaces_agents") is not None)
