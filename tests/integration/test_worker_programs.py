"""The programs tpulaunch sends to TPU workers over gcloud ssh (`cluster/worker_stop.py`,
`cluster/worker_query.py`), run as they are sent: their own source with `python -c`, no tpulaunch
import on the other side."""

from __future__ import annotations

import json
import os
import shlex
import socket
import subprocess
import sys
import time

import pytest

from tpulaunch.cluster import ownership, worker_commands, worker_query, worker_stop


def _answer(command: str) -> dict:
    proc = subprocess.run(["bash", "-c", command], capture_output=True, text=True, timeout=60,
                          env={"PATH": os.environ["PATH"]})  # nothing of tpulaunch's on the other side
    line = next(l for l in proc.stdout.splitlines() if l.startswith(worker_commands.JSON_MARK))
    return json.loads(line[len(worker_commands.JSON_MARK):])


@pytest.mark.parametrize("keep_dir", [False, True], ids=["down", "after a failed ray start"])
def test_the_stop_program_ends_the_clusters_processes_only_and_removes_its_marked_dir(tmp_path, keep_dir):
    """`cluster down` removes the marked dir; a `ray start` that failed keeps it (Ray's logs, which
    its error points at)."""
    assert worker_stop.MARKER == ownership.MARKER and worker_stop.JSON_MARK == worker_commands.JSON_MARK
    d = tmp_path / "ray-tmp"
    d.mkdir()
    (d / ownership.MARKER).write_text(json.dumps({"cluster_id": "cid-1"}))
    # ours, and below it a process whose environment shows nothing (as a Ray agent that renamed itself)
    ours = subprocess.Popen(["bash", "-c", "env -i sleep 60 & wait"], env={**os.environ, ownership.ID_ENV: "cid-1"})
    other = subprocess.Popen(["sleep", "60"], env={**os.environ, ownership.ID_ENV: "cid-2"})
    holder = subprocess.Popen(["sleep", "60"], stdout=open(d / "out.log", "w"))  # a user's `tail -f` of a log inside
    time.sleep(0.3)
    try:
        doc = _answer(worker_commands.stop_command(sys.executable, str(d), "cid-1", keep_dir=keep_dir))
        assert doc == {"stopped": 2, "left": [], "removed": not keep_dir}
        assert ours.wait(5) is not None
        assert other.poll() is None and holder.poll() is None  # not the cluster's: left alone
        assert d.exists() == keep_dir and (d / "out.log").exists() == keep_dir
    finally:
        for p in (ours, other, holder):
            p.kill()
            p.wait()


def test_the_query_program_says_when_no_head_listens():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound, not listening: refused
        command = f"{shlex.quote(sys.executable)} -c {shlex.quote(open(worker_query.__file__).read())} 127.0.0.1:{port}"
        doc = _answer(command)
    assert doc["head"] is False and doc["nodes"] == [] and doc["error"]
