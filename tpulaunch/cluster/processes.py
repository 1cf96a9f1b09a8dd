"""The local processes of one Ray cluster, found by its temp dir, and of one run, found by its id.

Each cluster tpulaunch starts on this machine gets its own Ray temp dir; a process belongs to the
cluster when its argv, its environment or one of its open files names that dir. Stopping by
that rule ends exactly one cluster's processes (never another Ray the user runs).
"""

from __future__ import annotations

import shutil

from tpulaunch import procfs
from tpulaunch.plan.launch import run_marker


def cluster_pids(temp_dir: str) -> list[int]:
    """Processes of the Ray cluster living in `temp_dir`.

    Most name it in argv; some (Ray's client server) only inherit it in their environment
    (`RAY_AUTH_TOKEN_PATH` points into it), and Ray's agents rename their argv but keep their
    log files in it open.
    """
    needle = temp_dir.encode()
    out = []
    for proc in procfs.processes():
        if (needle in proc.cmdline() or needle in proc.environ()
                or any(f.startswith(temp_dir) for f in proc.open_files())):
            out.append(proc.pid)
    return out


def stop_processes(temp_dir: str, grace_s: float = 5.0) -> int:
    """Stop every process of the cluster living in `temp_dir`, then remove it; returns how many ran."""
    pids = cluster_pids(temp_dir)
    procfs.stop(lambda: cluster_pids(temp_dir), grace_s)
    shutil.rmtree(temp_dir, ignore_errors=True)
    return len(pids)


def run_pids(run_id: str) -> list[int]:
    """Host processes of one run on this machine: their environment holds its TPULAUNCH_RUN_ID, or
    (a spare that took the run) they hold its heartbeat file open, named `tpulaunch-run-<id>-...`."""
    env_needle = f"TPULAUNCH_RUN_ID={run_id}".encode()
    fd_needle = "/" + run_marker(run_id)
    return [p.pid for p in procfs.processes() if procfs.alive(p.pid)
            and (env_needle in p.environ() or any(fd_needle in f for f in p.open_files()))]


def stop_run_processes(run_id: str, grace_s: float = 3.0) -> int:
    """SIGTERM, then SIGKILL after `grace_s`, the host processes of a run that Ray can no longer stop."""
    pids = run_pids(run_id)
    procfs.stop(lambda: run_pids(run_id), grace_s)
    return len(pids)
