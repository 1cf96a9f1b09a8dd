"""Local processes found by what they name: a directory (`dir_pids`), a run (`run_pids`).

Which processes a *cluster* has, and so which `cluster down` may stop, is `ownership.py`'s rule;
this module only reads /proc and stops the host processes of one run.
"""

from __future__ import annotations

import os

from tpulaunch import procfs
from tpulaunch.plan.launch import run_marker


def names_dir(proc: procfs.Process, path: str) -> bool:
    """`proc` names `path` as an argument or holds a file open inside it, path component by path
    component (`/tmp/tpl-ab` never matches `/tmp/tpl-abc`)."""
    inside = path.rstrip("/") + "/"
    args = [a.decode(errors="replace") for a in proc.cmdline().split(b"\0")]
    if any(a == inside[:-1] or a.startswith(inside) for a in args):
        return True
    return any(f.startswith(inside) for f in proc.open_files())


def dir_pids(path: str) -> list[int]:
    """Live processes of this user naming `path` (see `names_dir`); a read, never a reason to stop."""
    me = os.getuid()
    return [p.pid for p in procfs.processes() if procfs.alive(p.pid) and p.uid() == me and names_dir(p, path)]


def run_pids(run_id: str) -> list[int]:
    """Host processes of one run on this machine: their environment holds its TPULAUNCH_RUN_ID, or
    (forked by a spare) they hold its heartbeat file open, named `tpulaunch-run-<id>-...`."""
    env_needle = f"TPULAUNCH_RUN_ID={run_id}".encode()
    fd_needle = "/" + run_marker(run_id)
    # only a spare (`tpulaunch.host.bootstrap --spare`) has its fds read: a raylet holds hundreds
    return [p.pid for p in procfs.processes() if procfs.alive(p.pid)
            and (env_needle in p.environ() or (b"tpulaunch.host.bootstrap" in p.cmdline()
                                               and any(fd_needle in f for f in p.open_files())))]


def stop_run_processes(run_id: str, grace_s: float = 3.0) -> int:
    """SIGTERM, then SIGKILL after `grace_s`, the host processes of a run that Ray can no longer stop."""
    pids = run_pids(run_id)
    procfs.stop(lambda: run_pids(run_id), grace_s)
    return len(pids)
