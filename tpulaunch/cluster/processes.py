"""The local processes of one Ray cluster, found by its temp dir, and how to end them.

Each cluster tpulaunch starts on this machine gets its own Ray temp dir; a process belongs to the
cluster when its argv, its environment or one of its open files names that dir. Stopping by
that rule ends exactly one cluster's processes (never another Ray the user runs).
"""

from __future__ import annotations

import os
import shutil
import signal
import time

from tpulaunch.plan.launch import run_marker


def cluster_pids(temp_dir: str) -> list[int]:
    """Processes of the Ray cluster living in `temp_dir`.

    Most name it in argv; some (Ray's client server) only inherit it in their environment
    (`RAY_AUTH_TOKEN_PATH` points into it), so both are searched.
    """
    me = os.getpid()
    needle = temp_dir.encode()
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == me:
            continue
        if _mentions(entry, needle, temp_dir):
            out.append(int(entry))
    return out


def _mentions(pid: str, needle: bytes, temp_dir: str) -> bool:
    """argv, environment, or an open file inside temp_dir (Ray's agents rename their argv)."""
    for part in ("cmdline", "environ"):
        try:
            with open(f"/proc/{pid}/{part}", "rb") as f:
                if needle in f.read():
                    return True
        except OSError:
            return False
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            if os.readlink(f"/proc/{pid}/fd/{fd}").startswith(temp_dir):
                return True
    except OSError:
        pass
    return False


def stop_processes(temp_dir: str, grace_s: float = 5.0) -> int:
    """Stop every process of the cluster living in `temp_dir`, then remove it; returns how many ran."""
    pids = cluster_pids(temp_dir)
    for pid in pids:
        _signal(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and any(alive(p) for p in pids):
        time.sleep(0.1)
    for pid in cluster_pids(temp_dir):
        _signal(pid, signal.SIGKILL)
    shutil.rmtree(temp_dir, ignore_errors=True)
    return len(pids)


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def alive(pid: int) -> bool:
    """Running (a zombie or a dead pid is not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[-1][:1] not in ("Z", "X")
    except OSError:
        return False


def run_pids(run_id: str) -> list[int]:
    """Host processes of one run on this machine: their environment holds its TPULAUNCH_RUN_ID, or
    (a spare that took the run) they hold its heartbeat file open, named `tpulaunch-run-<id>-...`."""
    env_needle = f"TPULAUNCH_RUN_ID={run_id}".encode()
    fd_needle = "/" + run_marker(run_id)
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid() or not alive(int(entry)):
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                if env_needle in f.read():
                    out.append(int(entry))
                    continue
            for fd in os.listdir(f"/proc/{entry}/fd"):
                if fd_needle in os.readlink(f"/proc/{entry}/fd/{fd}"):
                    out.append(int(entry))
                    break
        except OSError:
            continue
    return out


def stop_run_processes(run_id: str, grace_s: float = 3.0) -> int:
    """SIGTERM, then SIGKILL after `grace_s`, the host processes of a run that Ray can no longer stop."""
    pids = run_pids(run_id)
    for pid in pids:
        _signal(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and any(alive(p) for p in pids):
        time.sleep(0.1)
    for pid in run_pids(run_id):
        _signal(pid, signal.SIGKILL)
    return len(pids)
