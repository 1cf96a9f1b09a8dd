"""One queue of work for the pytest processes `./scripts/test` runs side by side.

Every process collects the whole suite and takes *units* from a queue they share (a directory: a unit
is taken by the process whose `mkdir` of its name succeeds), largest first, until none is left. A unit
is what must run in one process, in order:

* the tests on the shared emulated cluster (`shared_cluster`: some follow each other's state),
* the tests on the side cluster (`side_cluster`),
* every other module's tests (their own clusters, fake clouds, or nothing: the unit tier's modules).

Each unit ends with its fixtures torn down, session-scoped ones too (the next test pytest is told
of is none): a cluster is up only while its unit runs, and a unit never sees what another left.

Why: with the modules split between the processes beforehand, the processes ended up to 130 s
apart in fresh clones (how long a module takes moves with the machine's hour), and the last one ran
on alone. Taken from a queue, the work ends within about one module of each other.
"""

from __future__ import annotations

import os
import re
import time
from pathlib import Path

import pytest

import machine

QUEUE = os.environ.get("TPULAUNCH_TEST_QUEUE")

# The units that take longest, first, by their seconds in four-process fresh-clone runs (2026-11-28:
# the shared cluster's 554-601, test_gke 549-573, test_recreate 503-528, the side cluster's 458-480,
# elastic 123-133, spares 99-104, node starts 79-80, cluster_remote 58-63, the hang 56-61, TorchTPU
# 39-60, the warm cluster 36-39, rehearsal 21-32, faults 25-32); the rest follow, the integration
# modules before the unit tier's, whose slowest (waits on a clock: 10-26 s) go first among them, so
# that the last units taken are the many small ones and the processes end together.
FIRST = ("shared cluster", "test_gke.py", "test_recreate.py", "side cluster", "test_elastic.py", "test_spares.py",
         "test_node_start.py", "test_cluster_remote.py", "test_hang.py", "test_torch_tpu.py", "test_warm.py",
         "test_rehearsal_runs.py", "test_faults.py")
SLOW_UNIT_TIER = ("test_slice_capacity.py", "test_placement.py")


def unit_of(item: pytest.Item) -> str:
    for cluster in ("shared_cluster", "side_cluster"):
        if cluster in item.fixturenames:
            return cluster.replace("_", " ")
    return item.path.name


def units(items: list[pytest.Item]) -> dict[str, list[pytest.Item]]:
    """The session's items as units, in the order they are taken (each unit's items in session order)."""
    out: dict[str, list[pytest.Item]] = {}
    for item in items:
        out.setdefault(unit_of(item), []).append(item)

    def rank(name: str) -> tuple[int, bool, int]:
        slow = SLOW_UNIT_TIER.index(name) if name in SLOW_UNIT_TIER else len(SLOW_UNIT_TIER)
        return (FIRST.index(name) if name in FIRST else len(FIRST), "/tests/unit/" in str(out[name][0].path), slow)

    return {name: out[name] for name in sorted(out, key=rank)}


TAKEN: list[tuple[str, int, float]] = []  # what this process ran: (unit, tests, seconds)


def _take(queue: Path, names: list[str]):
    """The units this process takes, one at a time, as it asks for the next."""
    for name in names:
        try:
            (queue / re.sub(r"[^\w.-]", "_", name)).mkdir()
        except FileExistsError:
            continue
        yield name


@pytest.hookimpl(tryfirst=True)
def pytest_runtestloop(session: pytest.Session) -> bool | None:
    if not QUEUE or session.config.option.collectonly:
        return None  # pytest's own loop
    if session.testsfailed and not session.config.option.continue_on_collection_errors:
        raise session.Interrupted(f"{session.testsfailed} error(s) during collection")
    work = units(session.items)
    mine = _take(Path(QUEUE), list(work))
    name = next(mine, None)
    while name is not None:
        items = work[name]
        t0 = time.monotonic()
        for i, item in enumerate(items):
            # the last item of a unit: nothing after it, so that every fixture is torn down
            nextitem = items[i + 1] if i + 1 < len(items) else None
            item.config.hook.pytest_runtest_protocol(item=item, nextitem=nextitem)
            if session.shouldfail:
                raise session.Failed(session.shouldfail)
            if session.shouldstop:
                raise session.Interrupted(session.shouldstop)
        TAKEN.append((name, len(items), time.monotonic() - t0))
        name = next(mine, None)
    return True


def pytest_terminal_summary(terminalreporter) -> None:
    if QUEUE and TAKEN:
        took = ", ".join(f"{name} ({n}, {s:.0f} s)" for name, n, s in TAKEN)
        terminalreporter.write_line(f"this process took: {took}")
        terminalreporter.write_line(machine.report())
