"""A host of a one-process-per-device framework (torch_tpu): start one child per device, watch them
as one host.

The agent supervises this process like any host process (logs, heartbeat, stall, stacks: `py-spy
dump --subprocesses`). Here:

* each child is a fork of this process once it has imported torch (the framework's `preload`:
  with the device backend's autoload held back, so no child inherits a device another opened),
  with the host's environment plus its own part of the contract (`plan.torch_tpu.processes`); it
  then boots as `python -m tpulaunch.host.bootstrap STATE --rank L` would. A host of 8 devices
  imports torch once, not 8 times side by side (3 to 5 CPU-s each on 2-core machines);
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
import sys
import threading
import time
import traceback
from collections.abc import Callable

from tpulaunch import procfs
from tpulaunch.host import frameworks
from tpulaunch.host.context import TIMINGS_ENV
from tpulaunch.host.spare import become_fresh
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


def _pump(stream, out, tag: str, lock: threading.Lock) -> None:  # a binary pipe, a text file
    for raw in iter(stream.readline, b""):
        text = raw.decode("utf-8", "backslashreplace").rstrip("\n")
        with lock:
            try:
                out.write(tag + text + "\n")
            except (ValueError, OSError):
                pass
    stream.close()


class Child:
    """One device's process, forked from this one: what the loop below asks of it (a Popen's)."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:  # reaped elsewhere: its code is lost
                self.returncode = -1
                return self.returncode
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)  # -N for signal N, as Popen's
        return self.returncode

    def wait(self, timeout: float) -> int | None:
        deadline = time.monotonic() + timeout
        while self.poll() is None and time.monotonic() < deadline:
            time.sleep(0.01)
        return self.returncode


RankMain = Callable[[list[str]], int]  # the bootstrap's: argv [STATE, "--rank", L] -> exit code


def fork_rank(rank_main: RankMain, state_path: str, local_rank: int, env: dict[str, str]) -> tuple[Child, int, int]:
    """Fork the process of `local_rank` with `env`: its output on two new pipes (read ends returned).
    In the child this never returns: it runs `rank_main` (boot, then the script) and exits with its code."""
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    pid = os.fork()
    if pid:
        os.close(out_w)
        os.close(err_w)
        return Child(pid), out_r, err_r
    code = 70
    try:
        for fd in (out_r, err_r, *_READ_ENDS):
            os.close(fd)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        become_fresh(out_w, err_w, env)
        # the host's Python streams are its own pipes to the agent: the child's are fds 1 and 2
        host_out, host_err = sys.stdout, sys.stderr
        sys.stdout = open(1, "w", buffering=1, encoding="utf-8", errors="backslashreplace", closefd=False)
        sys.stderr = open(2, "w", buffering=1, encoding="utf-8", errors="backslashreplace", closefd=False)
        sys.__stdout__, sys.__stderr__ = sys.stdout, sys.stderr  # type: ignore[misc]  # Final to typeshed, on purpose
        for stream in (host_out, host_err):
            if stream.fileno() > 2:
                stream.close()
        code = rank_main([state_path, "--rank", str(local_rank)])
    except BaseException:  # the child must never return into the host's loop
        traceback.print_exc()
    finally:
        os._exit(code)


_READ_ENDS: list[int] = []  # this host's pipes from the children forked so far (a child closes them)


def run(state: HostState, state_path: str, rank_main: RankMain) -> int:
    """Start this host's processes (each running `rank_main`) and wait for them. Returns the host's
    exit code."""
    lock = threading.Lock()
    children: list[tuple[int, int, Child]] = []
    readers: list[threading.Thread] = []
    stopping = [0]

    def on_sigterm(signum: int, _frame: object) -> None:
        stopping[0] = signum

    frameworks.get(state.framework).preload()  # once here (a spare's fork has it), not once per child
    signal.signal(signal.SIGTERM, on_sigterm)
    signal.signal(signal.SIGINT, on_sigterm)
    pipes = []
    for p in processes(state):  # every fork before any thread of ours starts
        env = {**os.environ, **p.env}
        if p.local_rank:
            env.pop(TIMINGS_ENV, None)  # local rank 0 reports the host's phases
        child, out_r, err_r = fork_rank(rank_main, state_path, p.local_rank, env)
        _READ_ENDS.extend((out_r, err_r))
        children.append((p.rank, p.local_rank, child))
        pipes.append((p.rank, out_r, err_r))
    for rank, out_r, err_r in pipes:
        for fd, out in ((out_r, sys.stdout), (err_r, sys.stderr)):
            t = threading.Thread(target=_pump, args=(os.fdopen(fd, "rb"), out, prefix(rank), lock), daemon=True)
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
        assert child.returncode is not None  # failed: it has exited, with a code that is not 0
        code = procfs.exit_code(child.returncode)
        with lock:
            print(failed_line(rank, state.process_index, local, procfs.exit_reason(code), len(running)),
                  file=sys.stderr, flush=True)
    elif stopping[0]:
        code = 128 + stopping[0]
    procfs.stop([c[2].pid for c in children if c[2].poll() is None], GRACE_S)  # poll reaps the rest
    for _rank, _local, child in children:
        child.wait(timeout=1.0)
    for t in readers:
        t.join(timeout=2.0)
    return code
