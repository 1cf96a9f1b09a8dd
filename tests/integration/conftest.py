"""The integration tier: real Ray clusters, real torch_xla and JAX, real processes."""

from __future__ import annotations

import pytest


# Modules that use no shared cluster and no machine-wide state (each starts its own clusters or fake
# clouds, under a TPULAUNCH_HOME and temp dirs of its own): `./scripts/test` runs them beside the
# others (which share one emulated cluster), in two more pytest processes: those that run VMs
# through the fake Cloud TPU API and gcloud (`cloud`, after the unit tier), and the rest.
APART = {
    "test_cluster_remote.py", "test_elastic.py", "test_gcloud_config.py", "test_imports.py", "test_process_group.py",
    "test_recreate.py", "test_run_discovered.py", "test_spare.py", "test_torch_tpu.py", "test_torch_xla_mesh.py",
    "test_warm.py", "test_worker_programs.py",
}
CLOUD = {"test_cluster_remote.py", "test_gcloud_config.py", "test_recreate.py"}


def pytest_collection_modifyitems(config, items):
    for item in items:
        if "/tests/integration/" in str(item.fspath):
            item.add_marker(pytest.mark.integration)
            # a module in APART, or a test with a cluster of its own that does not touch the shared one
            own = item.get_closest_marker("lifecycle") is not None and "shared_cluster" not in item.fixturenames
            if item.fspath.basename in APART or own:
                item.add_marker(pytest.mark.apart)
            if item.fspath.basename in CLOUD:
                item.add_marker(pytest.mark.cloud)
    # A host whose agent or node a test replaces has a new agent, and a new agent has no spares: the
    # tests after it would start their hosts cold. They run last (pytest keeps the order otherwise).
    items[:] = ([i for i in items if i.get_closest_marker("replaces_agents") is None]
                + [i for i in items if i.get_closest_marker("replaces_agents") is not None])
