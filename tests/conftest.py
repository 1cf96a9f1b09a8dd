"""Shared test set-up.

* Output is pinned (NO_COLOR, COLUMNS) so CLI assertions are exact (`support.py` sets them).
* The emulated Ray cluster used by launch tests is started once per session (`shared_cluster`)
  and shared; a second one of its shape (`side_cluster`, no spares) serves some of its tests
  beside it; only lifecycle tests start their own.
* `tests/unit/` is the unit tier (`./scripts/test -m unit`), `tests/integration/` the rest.
* `./scripts/test` (no arguments) runs four pytest processes side by side, which take the suite's
  units (the shared cluster's tests, the side cluster's, each other module) from one queue, largest
  first (`streams.py`). Each process spends much of its time waiting on processes (run alone, the
  shared cluster's tests used 1.3 cores of two: 643 CPU-s in 489 s), so the others come off the
  wall time (why four on 2 cores: `scripts/test`). The side cluster takes Ray Train's fits, the per-host input checks, the detached
  runs', the Python client's and goodput's tests off the shared one, whose unit would otherwise
  take longer than half the suite. (pytest-xdist's `loadgroup` would do it, but its 3.8 cannot
  group on pytest 9.2, whose nodes keep their id elsewhere.)
* Every process the suite starts compiles XLA programs for the CPU without LLVM's optimizations
  (`XLA_FLAGS=--xla_backend_optimization_level=0`, unless XLA_FLAGS is set already), as a user's
  shell could. The suite's scripts run a few steps each, so compiling dominates their time: the
  transformer recipe on 4 emulated hosts takes 18 s instead of 25.5 s (scripts/bench's figures
  are measured without it). The numbers are the same: no fast-math either way; losses printed
  by both agree to every digit.
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_backend_optimization_level=0")

import pytest

from streams import pytest_runtestloop, pytest_terminal_summary  # noqa: F401 (hooks: `./scripts/test`'s queue)
from support import SHARED, emulated_cluster


@pytest.fixture(scope="session")
def shared_cluster(tmp_path_factory):
    """One warm emulated slice (`tpulaunch cluster up`, `support.SHARED`: a v5p-16, 2 hosts of 4 chips)
    for every test that launches on it.

    Yields {"env": env reaching it (TPULAUNCH_HOME), "info": the `cluster up --json` document, "home",
    "record": its `cluster.json`} (`support.emulated_cluster`).
    """
    # no dashboard: its tests start no detached run (Ray jobs, which the side cluster's tests start)
    with emulated_cluster(tmp_path_factory.mktemp("tpl-home"), *SHARED, "--no-dashboard") as cluster:
        yield cluster


@pytest.fixture(scope="session")
def side_cluster(tmp_path_factory):
    """A second emulated slice shaped as the shared one, with no spares, for the modules that need a
    cluster of that shape but no warm host and nothing another test left (Ray Train's fits, whose
    workers are Ray Train's own actors; per-host input; the Python client; goodput; detached runs;
    the hostile inputs that only read a cluster with the dashboard):
    a unit of their own in `./scripts/test`'s queue, beside the shared cluster's tests (`streams.py`).
    """
    # --dashboard: detached runs are Ray jobs; Ray Train's placement-group cleaner asks the state API
    with emulated_cluster(tmp_path_factory.mktemp("tpl-side"), *SHARED, "--dashboard", "--prewarm", "none") as cluster:
        yield cluster
