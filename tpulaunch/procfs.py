"""Processes on this machine, read from /proc, and the one way tpulaunch stops them.

Every walk of /proc in tpulaunch goes through `processes()` and the readers beside it, and every
stop is `stop()`: SIGTERM, a grace period, SIGKILL, a short wait. Nothing here decides *which*
processes are to be stopped; callers do, from evidence they can name (a temp dir of theirs, a run
id, recorded pids and start times).
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

PROC = "/proc"


@dataclass(frozen=True)
class Process:
    """What /proc says of one live process (read lazily: each reader may fail once it is gone)."""

    pid: int

    def read(self, part: str) -> bytes:
        with open(f"{PROC}/{self.pid}/{part}", "rb") as f:
            return f.read()

    def cmdline(self) -> bytes:
        """argv joined by NUL bytes (empty for a kernel thread or a process we may not read)."""
        try:
            return self.read("cmdline")
        except OSError:
            return b""

    def environ(self) -> bytes:
        """The environment it was started with, NUL-separated (empty when unreadable)."""
        try:
            return self.read("environ")
        except OSError:
            return b""

    def env(self) -> dict[str, str] | None:
        """Its starting environment as a dict; None when unreadable."""
        try:
            raw = self.read("environ")
        except OSError:
            return None
        return dict(item.decode(errors="replace").split("=", 1) for item in raw.split(b"\0") if b"=" in item)

    def open_files(self) -> list[str]:
        """Targets of its open file descriptors (paths, `pipe:[..]`, `socket:[..]`)."""
        out: list[str] = []
        try:
            fds = os.listdir(f"{PROC}/{self.pid}/fd")
        except OSError:
            return out
        for fd in fds:
            try:
                out.append(os.readlink(f"{PROC}/{self.pid}/fd/{fd}"))
            except OSError:
                continue
        return out

    def _stat(self) -> list[str]:
        # the comm field may hold spaces and parentheses: split after the last ')'
        return self.read("stat").decode(errors="replace").rsplit(")", 1)[1].split()

    def state(self) -> str:
        """One letter: R, S, D, Z (zombie), X (dead), ...; "" when gone."""
        try:
            return self._stat()[0]
        except (OSError, IndexError):
            return ""

    def _stat_number(self, field: int) -> int | None:
        """Field `field` of its stat line after the name (0: state); None when gone."""
        try:
            return int(self._stat()[field])
        except (OSError, IndexError, ValueError):
            return None

    def ppid(self) -> int | None:
        return self._stat_number(1)

    def pgid(self) -> int | None:
        """Its process group; None when gone."""
        return self._stat_number(2)

    def uid(self) -> int | None:
        """The real user id it runs as; None when gone."""
        try:
            return os.stat(f"{PROC}/{self.pid}").st_uid
        except OSError:
            return None

    def name(self) -> str:
        """Its command's name (argv[0] without the directory), for messages."""
        argv0 = self.cmdline().split(b"\0", 1)[0].decode(errors="replace")
        if argv0:
            return os.path.basename(argv0)
        try:
            return self.read("comm").decode(errors="replace").strip()
        except OSError:
            return "?"


_PR_SET_CHILD_SUBREAPER = 36


def become_subreaper() -> bool:
    """Orphans of our children come to us, not to init (PR_SET_CHILD_SUBREAPER), so we can wait for
    them when we end them. False if the kernel refused."""
    import ctypes

    try:
        return ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    except OSError:
        return False


_PR_SET_PDEATHSIG = 1
_PR_SET_PTRACER, _PR_SET_PTRACER_ANY = 0x59616D61, -1


def die_with_parent() -> None:
    """In a child of ours: SIGKILL when its parent dies (PR_SET_PDEATHSIG: an agent's host process
    goes with the agent, its node lost), and a sibling py-spy may read it (Yama's PR_SET_PTRACER)."""
    import ctypes

    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        libc.prctl(_PR_SET_PTRACER, ctypes.c_ulong(_PR_SET_PTRACER_ANY & 0xFFFFFFFFFFFFFFFF), 0, 0, 0)
    except OSError:
        pass


def reap(pids: Iterable[int], timeout_s: float = 2.0) -> None:
    """Wait for those of `pids` that are our children (orphans handed to us as subreaper), so none
    outlives us as a zombie in our process group. Others are not ours to wait for: skipped."""
    deadline = time.monotonic() + timeout_s
    for pid in set(pids):
        while True:
            try:
                done, _ = os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                break  # not our child (or already waited for)
            if done or time.monotonic() >= deadline:
                break
            time.sleep(0.02)


def alive(pid: int) -> bool:
    """Running (a zombie or a dead pid is not)."""
    return Process(pid).state() not in ("", "Z", "X")


def processes(skip_self: bool = True) -> Iterator[Process]:
    """Every process on this machine (our own excepted), live or not yet reaped."""
    me = os.getpid()
    for entry in os.listdir(PROC):
        if entry.isdigit() and not (skip_self and int(entry) == me):
            yield Process(int(entry))


def ancestors(pid: int | None = None) -> set[int]:
    """`pid` (default: this process) and every process above it."""
    out: set[int] = set()
    p: int | None = pid or os.getpid()
    while p and p > 1 and p not in out:
        out.add(p)
        p = Process(p).ppid()
    return out


def child_pids(pid: int) -> list[int] | None:
    """`pid`'s children, from the kernel's per-thread lists (no walk of /proc); None where the
    kernel keeps none (CONFIG_PROC_CHILDREN off)."""
    out: list[int] = []
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                out += [int(c) for c in f.read().split()]
    except FileNotFoundError:
        return None if alive(pid) else []
    except OSError:
        return []
    return out


def children_map() -> dict[int, list[int]]:
    """ppid -> live child pids, from one walk of /proc."""
    kids: dict[int, list[int]] = {}
    for proc in processes(skip_self=False):
        if proc.state() in ("", "Z", "X"):
            continue
        parent = proc.ppid()
        if parent is not None:
            kids.setdefault(parent, []).append(proc.pid)
    return kids


def subtree(pid: int) -> dict[int, list[int]]:
    """ppid -> child pids for `pid` and everything below it, from the kernel's per-thread lists:
    what `descendants` needs without a walk of all of /proc (on a machine of many emulated hosts,
    every host's walk reads every other host's processes). The whole walk where the kernel keeps
    no lists."""
    kids: dict[int, list[int]] = {}
    todo = [pid]
    while todo:
        p = todo.pop()
        found = child_pids(p)
        if found is None:
            return children_map()
        live = [c for c in found if alive(c)]
        if live:
            kids[p] = live
            todo += live
    return kids


def descendants(pid: int, kids: dict[int, list[int]] | None = None) -> list[int]:
    """Every live process below `pid` (not `pid` itself); `kids` from `subtree` or `children_map`."""
    kids = subtree(pid) if kids is None else kids
    out, todo = [], list(kids.get(pid, []))
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(kids.get(p, []))
    return out


def _send(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def stop(pids: Iterable[int] | Callable[[], Iterable[int]], grace_s: float = 3.0,
         kill_wait_s: float = 2.0) -> list[int]:
    """SIGTERM, then SIGKILL whatever is still alive after `grace_s`; returns the pids left alive.

    `pids` may be a function: it is asked again before SIGKILL, so processes that appeared in the
    meantime (a child forked while its parent was dying) are stopped too.
    """
    find = pids if callable(pids) else (lambda fixed=list(pids): fixed)
    first = [p for p in find() if alive(p)]
    for pid in first:
        _send(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and any(alive(p) for p in first):
        time.sleep(0.05)
    rest = [p for p in set(first) | set(find()) if alive(p)]
    for pid in rest:
        _send(pid, signal.SIGKILL)
    deadline = time.monotonic() + kill_wait_s
    while time.monotonic() < deadline and any(alive(p) for p in rest):
        time.sleep(0.05)
    return [p for p in rest if alive(p)]


def exit_code(returncode: int) -> int:
    """Popen's `-N` (killed by signal N) becomes the shell's `128+N`."""
    return 128 - returncode if returncode < 0 else returncode


def exit_reason(code: int) -> str:
    """`exit 3`, or `killed by signal 9 (SIGKILL)` for the shell's 128+N."""
    if 128 < code < 128 + 65:
        try:
            name = signal.Signals(code - 128).name
        except ValueError:
            name = "?"
        return f"killed by signal {code - 128} ({name})"
    return f"exit {code}"
