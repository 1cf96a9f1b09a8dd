"""`tpulaunch cluster join`: Ray started on the TPU VM this runs on (worker 0 the head, others join it).

The slice's other path, `cluster up --tpu` from anywhere gcloud works, is `remote.py`; both start Ray
with the same words (`worker_commands.ray_start_words`) and token auth on.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable

from tpulaunch.cluster.worker_commands import (
    DEFAULT_PORT,
    default_temp_dir,
    local_auth_env,
    output_tail,
    ray_start_words,
)
from tpulaunch.errors import ClusterError
from tpulaunch.plan.slicespec import SliceSpec


def _reachable(ip: str, port: int, timeout: float = 2.0) -> bool:
    try:
        socket.create_connection((ip, port), timeout=timeout).close()
        return True
    except OSError:
        return False


def join_local(
    spec: SliceSpec, worker_id: int, token_path: str, *, port: int = DEFAULT_PORT, temp_dir: str | None = None,
    timeout: float = 300.0, python: str | None = None, dashboard: bool = False,
    progress: Callable[[str], None] | None = None,
) -> str:
    """Start the head (worker 0) or join it (others), retrying until the head answers or `timeout`.

    Returns the head address. Runs `ray start` on this machine with token auth on.
    """
    say = progress or (lambda _m: None)
    if not spec.workers:
        raise ClusterError("the metadata server lists no worker endpoints", "is this a TPU VM of a READY slice?")
    head_ip, me = spec.workers[0].ip, spec.workers[worker_id].ip
    tdir = temp_dir or default_temp_dir(spec.project or "-", spec.zone or "-", spec.name)
    words = ray_start_words(python=python or sys.executable, node_ip=me, temp_dir=tdir, port=port,
                            head=worker_id == 0, head_ip=head_ip, dashboard=dashboard)
    env = {**os.environ, **local_auth_env(token_path)}
    deadline = time.monotonic() + timeout
    if worker_id != 0:
        say(f"waiting for the Ray head at {head_ip}:{port}")
        while not _reachable(head_ip, port):
            if time.monotonic() >= deadline:
                raise ClusterError(f"the Ray head at {head_ip}:{port} did not answer within {timeout:g}s",
                                   "start it with `tpulaunch cluster join` on worker 0, or raise --timeout")
            time.sleep(min(2.0, max(0.0, deadline - time.monotonic())))
    last = ""
    while True:
        left = max(5.0, deadline - time.monotonic())
        try:
            proc = subprocess.run(words, env=env, capture_output=True, text=True, timeout=left)
        except subprocess.TimeoutExpired:
            proc = None
        if proc is not None and proc.returncode == 0:
            say("head started" if worker_id == 0 else f"joined {head_ip}:{port}")
            return f"{head_ip}:{port}"
        last = output_tail(proc) if proc is not None else "ray start timed out"
        if time.monotonic() >= deadline:
            raise ClusterError(f"ray start on worker {worker_id} kept failing for {timeout:g}s: {last}",
                               f"Ray's logs are under {tdir}")
        time.sleep(2.0)
