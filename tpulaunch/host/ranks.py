"""A host of a one-process-per-device framework (torch_tpu): start one child per device, watch them
as one host.

The agent supervises this process like any host process (logs, heartbeat, stall, stacks: `py-spy
dump --subprocesses`). Here:

* each child is `python -m tpulaunch.host.bootstrap STATE --rank L`, with the host's environment
  plus its own part of the contract (`plan.torch_tpu.processes`);
* each line a child prints is passed on prefixed `[rank R] ` (the launcher files it under
  `host-<i>/rank-R.log` as well as `host-<i>.log`), on the stream it came from;
* the first child to fail fails the host: one line names it (`FAILED_LINE`, which the launcher
  reads to blame the rank), the others get SIGTERM then SIGKILL, and the host exits with the
  failed child's code (128+N for a signal), as torchrun's agent does;
* SIGTERM to this process (the launcher stopping the host) stops the children, then exits 143.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time

from tpulaunch import procfs
from tpulaunch.host.context import TIMINGS_ENV
from tpulaunch.plan.contract import HostState
from tpulaunch.plan.torch_tpu import processes

GRACE_S = 5.0  # the others' time to leave after one failed (torchrun waits 30 s; a host has less)
PREFIX_RE = re.compile(r"^\[rank (\d+)\] ")
FAILED_RE = re.compile(r"^tpulaunch: rank (\d+) \(host (\d+), local rank (\d+)\) failed: (.+?)(;|$)")


def prefix(rank: int) -> str:
    return f"[rank {rank}] "


def failed_line(rank: int, host: int, local: int, reason: str, others: int) -> str:
    """The line that names the first failed process (`FAILED_RE` reads it back)."""
    return (f"tpulaunch: rank {rank} (host {host}, local rank {local}) failed: {reason};"
            f" stopping this host's other {others} process(es)")


def _pump(stream, out, tag: str, lock: threading.Lock) -> None:  # noqa: ANN001 - a binary pipe, a text file
    for raw in iter(stream.readline, b""):
        text = raw.decode("utf-8", "backslashreplace").rstrip("\n")
        with lock:
            try:
                out.write(tag + text + "\n")
            except (ValueError, OSError):
                pass
    stream.close()


def run(state: HostState, state_path: str) -> int:
    """Start this host's processes and wait for them. Returns the host's exit code."""
    lock = threading.Lock()
    children: list[tuple[int, int, subprocess.Popen]] = []
    readers: list[threading.Thread] = []
    stopping = [0]

    def on_sigterm(signum: int, _frame: object) -> None:
        stopping[0] = signum

    signal.signal(signal.SIGTERM, on_sigterm)
    signal.signal(signal.SIGINT, on_sigterm)
    for p in processes(state):
        env = {**os.environ, **p.env}
        if p.local_rank:
            env.pop(TIMINGS_ENV, None)  # local rank 0 reports the host's phases
        child = subprocess.Popen(
            [sys.executable, "-m", "tpulaunch.host.bootstrap", state_path, "--rank", str(p.local_rank)],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL)
        children.append((p.rank, p.local_rank, child))
        for stream, out in ((child.stdout, sys.stdout), (child.stderr, sys.stderr)):
            t = threading.Thread(target=_pump, args=(stream, out, prefix(p.rank), lock), daemon=True)
            t.start()
            readers.append(t)
    code = 0
    while True:
        running = [c for c in children if c[2].poll() is None]
        failed = [c for c in children if c[2].returncode not in (None, 0)]
        if stopping[0] or failed or not running:
            break
        time.sleep(0.05)
    if failed and not stopping[0]:
        rank, local, child = failed[0]
        code = procfs.exit_code(child.returncode)
        with lock:
            print(failed_line(rank, state.process_index, local, procfs.exit_reason(code), len(running)),
                  file=sys.stderr, flush=True)
    elif stopping[0]:
        code = 128 + stopping[0]
    procfs.stop([c[2].pid for c in children if c[2].poll() is None], GRACE_S)
    for _rank, _local, child in children:
        try:
            child.wait(timeout=1.0)
        except subprocess.TimeoutExpired:
            pass
    for t in readers:
        t.join(timeout=2.0)
    return code
