"""The integration tier: real Ray clusters, real torch_xla and JAX, real processes."""

from __future__ import annotations

import pytest


# Modules that use no shared cluster and no machine-wide state (each starts its own clusters or fake
# clouds, under a TPULAUNCH_HOME and temp dirs of its own, or uses the side cluster): `./scripts/test`
# runs them beside the others (which share one emulated cluster), in two more pytest processes: after
# the unit tier, those in WITH_UNIT (the modules that run VMs through the fake Cloud TPU API and
# gcloud, and one more, so that the streams' work is even), and the rest.
APART = {
    "test_client.py", "test_cluster_remote.py", "test_elastic.py", "test_gcloud_config.py", "test_goodput.py",
    "test_imports.py", "test_placement_input.py", "test_process_group.py", "test_ray_train.py",
    "test_recreate.py", "test_run_discovered.py", "test_spare.py", "test_torch_tpu.py", "test_torch_xla_mesh.py",
    "test_warm.py", "test_worker_programs.py",
}
WITH_UNIT = {"test_cluster_remote.py", "test_gcloud_config.py", "test_recreate.py", "test_torch_tpu.py"}


def pytest_collection_modifyitems(config, items):
    for item in items:
        if "/tests/integration/" in str(item.fspath):
            item.add_marker(pytest.mark.integration)
            # a module in APART, or a test with a cluster of its own that does not touch the shared one
            own = item.get_closest_marker("lifecycle") is not None and "shared_cluster" not in item.fixturenames
            if item.fspath.basename in APART or own:
                item.add_marker(pytest.mark.apart)
            if item.fspath.basename in WITH_UNIT:
                item.add_marker(pytest.mark.with_unit)
    # The side cluster's tests run last in their process, together (the session's cluster is up only
    # while they run). A host whose agent or node a test replaces has a new agent, and a new agent has
    # no spares: the tests after it would start their hosts cold. They run last of all. (A stable
    # sort: pytest's order otherwise.)
    items.sort(key=lambda i: ("side_cluster" in i.fixturenames, i.get_closest_marker("replaces_agents") is not None))
