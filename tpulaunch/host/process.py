"""One host process and everything it printed, for the host agent (`agent.py`).

Started fresh (`HostProcess.spawn`: the bootstrap, or `exec`'s command, in a session of its own) or
forked by the host's spare (`HostProcess.fork`, `spare.py`); either way the agent's child, read
through pipes line by line, waited for, stopped as a process group, and ended once its script's
process ends (what it left running is then stopped, or kept with --keep-children).
"""

from __future__ import annotations

import collections
import os
import select
import subprocess
import threading
import time
from collections.abc import Callable

from tpulaunch import procfs
from tpulaunch.host.context import PY_STDIO_ENV
from tpulaunch.host.spare import Adopted, Spare

DRAIN_S = 2.0  # after a host's script exits: how long the output still in its pipes may take to arrive


class HostProcess:
    """One host process and everything it printed: started fresh (`spawn`) or forked by a spare (`fork`).

    The host ends when its script's process ends: its exit code is final at once; output still in
    flight is read for `DRAIN_S`, then whatever the script left running (`leftovers`: daemons,
    servers, anything that forked, `setsid` included) is stopped and named in one line, unless
    `keep_children`. Nothing it left behind can hold the host "running" by holding its pipes.
    """

    # Every host process of this agent that has not exited, by pid. Starting one holds the lock,
    # so a sweep for one process's leftovers (which holds it too), or for orphans to reap, never
    # sees another half started: the next run's host starting is not the old one's leftover.
    spawning = threading.Lock()
    running: set[int] = set()

    def __init__(self, env: dict[str, str], start: Callable[[], tuple],
                 leftovers: Callable[[HostProcess], list[int]] | None = None) -> None:
        """`start()` starts the process: (a Popen or `Adopted`, [(stream name, binary pipe), ...])."""
        self.env = env
        self.lines: collections.deque = collections.deque()
        self.cond = threading.Condition()
        self.started = self.last_line = time.time()
        self.ended: float | None = None  # set once the host is over: exited, output drained, leftovers handled
        self.exited: float | None = None
        self.readers: list[threading.Thread] = []
        self.leftovers = leftovers or (lambda _h: [])
        self.keep_children = False
        self._stop_reading = threading.Event()
        with HostProcess.spawning:
            self.proc, streams = start()
            HostProcess.running.add(self.proc.pid)
        for name, stream in streams:
            t = threading.Thread(target=self._pump, args=(name, stream), daemon=True)
            t.start()
            self.readers.append(t)
        threading.Thread(target=self._reap, daemon=True).start()

    @classmethod
    def spawn(cls, argv: list[str], env: dict[str, str], cwd: str,
              leftovers: Callable[[HostProcess], list[int]] | None = None) -> HostProcess:
        """A fresh process: the bootstrap (or `exec`'s command) in its own session, dying with us."""
        py = argv[1:3] == ["-m", "tpulaunch.host.bootstrap"]
        # The bootstrap writes Python's sys.stdout/sys.stderr to pipes of their own: native code
        # (gloo, XLA) writing to fds 1/2 at the same time could otherwise split a printed line.
        pipes = [os.pipe(), os.pipe()] if py else []
        env = dict(env)
        if pipes:
            env[PY_STDIO_ENV] = f"{pipes[0][1]},{pipes[1][1]}"

        def start() -> tuple:
            try:
                proc = subprocess.Popen(
                    argv, env=env, cwd=cwd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                    start_new_session=True, preexec_fn=procfs.die_with_parent, bufsize=0,
                    pass_fds=[w for _r, w in pipes])
            except BaseException:
                for r, _w in pipes:
                    os.close(r)
                raise
            finally:
                for _r, w in pipes:
                    os.close(w)
            streams = [("stdout", proc.stdout), ("stderr", proc.stderr)]
            # no pipes of Python's own (not the bootstrap): none added
            return proc, streams + [(name, os.fdopen(r, "rb", buffering=0))
                                    for name, (r, _w) in zip(("stdout", "stderr"), pipes, strict=False)]

        return cls(env, start, leftovers)

    @classmethod
    def fork(cls, spare: Spare, state_path: str, env: dict[str, str], cwd: str, timeout_s: float,
             leftovers: Callable[[HostProcess], list[int]] | None = None) -> HostProcess:
        """A process forked by `spare` (its framework imported already) for one run's state."""

        def start() -> tuple:
            pid, fds = spare.fork(state_path, env, cwd, timeout_s)
            names = ("stdout", "stderr", "stdout", "stderr")  # fds 1, 2, then Python's own two
            return Adopted(pid), [(name, os.fdopen(fd, "rb", buffering=0)) for name, fd in zip(names, fds, strict=True)]

        return cls(env, start, leftovers)

    def push(self, stream: str, text: str) -> None:
        with self.cond:
            self.lines.append((stream, text))
            self.last_line = time.time()
            self.cond.notify_all()

    def _pump(self, name: str, stream) -> None:  # a binary pipe
        """Lines from one pipe until it closes, or until told to stop reading (the script ended and
        something it left behind, kept on purpose, still holds the pipe)."""
        fd, buf = stream.fileno(), b""
        while True:
            ready, _, _ = select.select([fd], [], [], 0.25)
            if not ready:
                if self._stop_reading.is_set():
                    break
                continue
            chunk = os.read(fd, 65536)
            if not chunk:
                break
            *whole, buf = (buf + chunk).split(b"\n")
            for raw in whole:
                self.push(name, raw.decode("utf-8", "replace").rstrip("\r"))
        if buf:
            self.push(name, buf.decode("utf-8", "replace").rstrip("\r"))
        stream.close()

    def _reap(self) -> None:
        self.proc.wait()
        HostProcess.running.discard(self.proc.pid)
        self.exited = time.time()  # the host's end (its output may still be draining)
        deadline = time.monotonic() + DRAIN_S
        for t in self.readers:
            t.join(max(0.0, deadline - time.monotonic()))
        self._end_leftovers()
        self._stop_reading.set()
        for t in self.readers:
            t.join(2.0)
        with self.cond:
            self.ended = time.time()
            self.cond.notify_all()

    def _end_leftovers(self) -> None:
        left = self.leftovers(self)
        if not left:
            return
        named = ", ".join(f"{procfs.Process(p).name()}, pid {p}" for p in left[:4]) + (" ..." if len(left) > 4 else "")
        what = f"the script left {len(left)} process{'es' if len(left) > 1 else ''} running ({named})"
        if self.keep_children:
            self.push("stderr", f"tpulaunch: {what}; left running (--keep-children)")
            return
        procfs.stop(lambda: self.leftovers(self), grace_s=2.0)
        self.push("stderr", f"tpulaunch: {what}; stopped")

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def done(self) -> bool:
        return self.ended is not None

    def code(self) -> int:
        return procfs.exit_code(self.proc.returncode)

    def terminate(self, grace_s: float = 3.0) -> int | None:
        """Stop the process group: SIGTERM, then SIGKILL after `grace_s`."""
        p = self.proc
        if p.poll() is None:
            procfs.stop(lambda: _group_members(p.pid), grace_s, kill_wait_s=5.0)
            try:
                p.wait(timeout=1.0)
            except subprocess.TimeoutExpired:
                pass
        for t in self.readers:
            t.join(timeout=DRAIN_S + 3.0)
        return procfs.exit_code(p.returncode) if p.returncode is not None else None


def _group_members(pgid: int) -> list[int]:
    """Live processes of process group `pgid` (the host process and what it started in its group)."""
    out = []
    for proc in procfs.processes():
        try:
            if os.getpgid(proc.pid) == pgid:
                out.append(proc.pid)
        except OSError:
            continue
    return out
