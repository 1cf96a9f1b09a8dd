"""Stop a kept emulated cluster once no run has used it for a while (`tpulaunch run --keep-cluster`).

    python -m tpulaunch.cluster.reaper HEX(TEMP_DIR) IDLE_SECONDS

A detached process on this machine. Every run on the cluster touches `<temp dir>/last_used`; when
that is older than the idle time, the reaper stops the cluster's processes and forgets its record.
It ends by itself when the cluster is gone (`tpulaunch cluster down`). The temp dir is passed hex-
encoded so that the reaper itself is not taken for a process of the cluster (they are found by
the temp dir in their argv).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

CHECK_EVERY_S = 10.0


def touch(temp_dir: str) -> None:
    """A run is using the cluster now."""
    try:
        Path(temp_dir, "last_used").touch()
    except OSError:
        pass


def start(temp_dir: str, idle_s: float) -> None:
    """Start the reaper of the cluster in `temp_dir` (detached; it outlives the launcher)."""
    touch(temp_dir)
    subprocess.Popen([sys.executable, "-m", "tpulaunch.cluster.reaper", temp_dir.encode().hex(), str(idle_s)],
                     stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                     start_new_session=True, close_fds=True)


def main(argv: list[str]) -> int:
    from tpulaunch.cluster.processes import cluster_pids, stop_processes
    from tpulaunch.cluster.record import clear_record, load_record

    temp_dir, idle_s = bytes.fromhex(argv[0]).decode(), float(argv[1])
    while True:
        time.sleep(CHECK_EVERY_S)
        if not cluster_pids(temp_dir):
            return 0
        try:
            idle = time.time() - os.stat(os.path.join(temp_dir, "last_used")).st_mtime
        except OSError:
            idle = idle_s
        if idle >= idle_s:
            rec = load_record()
            if rec is not None and rec.temp_dir == temp_dir:
                clear_record()
            stop_processes(temp_dir)
            return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
