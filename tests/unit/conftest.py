"""The unit tier: pure rules, in this process. No Ray cluster, no subprocess (`./scripts/test -m unit`).

Every test here is marked `unit`. A test that starts a process or connects to Ray fails, saying
so: such a test belongs in `tests/integration/`. (Reading Ray's own tables, as the catalog test
does with Ray's list of valid TPU topologies, is fine.)
"""

from __future__ import annotations

import subprocess
import sys

import pytest


def pytest_collection_modifyitems(config, items):
    for item in items:
        if "/tests/unit/" in str(item.fspath):
            item.add_marker(pytest.mark.unit)


@pytest.fixture(autouse=True)
def _no_processes_no_ray(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError(f"a unit test started a process: {args[:1]!r}; move it to tests/integration/")

    monkeypatch.setattr(subprocess.Popen, "__init__", refuse)
    yield
    ray = sys.modules.get("ray")
    assert ray is None or not ray.is_initialized(), "a unit test connected to Ray; move it to tests/integration/"
