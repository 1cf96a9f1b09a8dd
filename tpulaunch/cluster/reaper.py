"""Stop a kept emulated cluster once no run has used it for a while (`tpulaunch run --keep-cluster`).

    python -m tpulaunch.cluster.reaper HEX(TEMP_DIR) CLUSTER_ID IDLE_SECONDS

A detached process on this machine. Every run on the cluster touches `<temp dir>/last_used`; when
that is older than the idle time and no run is under way, the reaper stops the cluster's processes
and forgets its record. A run counts as under way while its launcher lives: it leaves its pid in
`<temp dir>/tpulaunch-runs/` for as long as it uses the cluster, so a training run longer than
the idle time is never stopped under it.

It ends by itself when the cluster is gone (`tpulaunch cluster down`). It stops the cluster as
`cluster down` does: the processes carrying the cluster's id, then its temp dir if still marked
for it (`ownership.py`).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

CHECK_EVERY_S = 10.0  # at most; a short idle time is checked more often (a third of it)


def touch(temp_dir: str) -> None:
    """A run is using the cluster now."""
    try:
        Path(temp_dir, "last_used").touch()
    except OSError:
        pass


@contextmanager
def in_use(temp_dir: str | None) -> Iterator[None]:
    """The cluster is in use for the duration (a run): the reaper leaves it up, however long."""
    if not temp_dir:
        yield
        return
    mark = Path(temp_dir, "tpulaunch-runs", str(os.getpid()))
    try:
        mark.parent.mkdir(exist_ok=True)
        mark.touch()
    except OSError:
        pass
    touch(temp_dir)
    try:
        yield
    finally:
        touch(temp_dir)
        mark.unlink(missing_ok=True)


def runs_under_way(temp_dir: str) -> list[int]:
    """Pids of the launchers using the cluster now (a mark whose launcher died does not count)."""
    from tpulaunch.procfs import alive

    live = []
    for mark in Path(temp_dir, "tpulaunch-runs").glob("*"):
        if mark.name.isdigit() and alive(int(mark.name)):
            live.append(int(mark.name))
        else:
            mark.unlink(missing_ok=True)
    return live


def start(temp_dir: str, cluster_id: str, idle_s: float) -> None:
    """Start the reaper of the cluster in `temp_dir` (detached; it outlives the launcher)."""
    from tpulaunch.cluster.ownership import ID_ENV

    touch(temp_dir)
    env = {k: v for k, v in os.environ.items() if k != ID_ENV}  # the reaper is not a process of the cluster
    subprocess.Popen([sys.executable, "-m", "tpulaunch.cluster.reaper", temp_dir.encode().hex(), cluster_id,
                      str(idle_s)],
                     stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                     start_new_session=True, close_fds=True, env=env)


def main(argv: list[str]) -> int:
    from tpulaunch.cluster.emulated import stop_owned
    from tpulaunch.cluster.ownership import cluster_running
    from tpulaunch.cluster.record import clear_record, load_record
    from tpulaunch.errors import TpulaunchError

    temp_dir, cluster_id, idle_s = bytes.fromhex(argv[0]).decode(), argv[1], float(argv[2])
    while True:
        time.sleep(min(CHECK_EVERY_S, idle_s / 3))
        if not cluster_running(cluster_id):
            return 0
        try:
            idle = time.time() - os.stat(os.path.join(temp_dir, "last_used")).st_mtime
        except OSError:
            idle = idle_s
        if idle >= idle_s and not runs_under_way(temp_dir):
            try:
                rec = load_record()
            except TpulaunchError:
                rec = None  # unreadable: leave it for `cluster down --force` to say so
            if rec is not None and rec.cluster_id == cluster_id:
                clear_record()
            stop_owned(cluster_id, temp_dir)
            return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
