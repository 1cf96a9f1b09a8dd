"""Warm hosts: one process per host imports the framework once and forks every run's host process.

After a run on a cluster that stays up (and at `cluster up --prewarm`), a host's agent starts a
*spare*: `python -m tpulaunch.host.bootstrap --spare FRAMEWORK`, in the environment every run like
it shares (`plan.env.split_env`). It imports the framework (the runtime untouched: no PJRT client,
no chips held) and waits. Each run with that environment is a fork of it: the child takes the
run's own environment, working directory and output pipes and becomes that run's host process;
the spare stays for the next run. So a run on a warm host pays no interpreter start and no
framework import (torch_xla: 4.5 to 7 CPU-s on 2-core machines, every run, every restart), where a
spare that served one run and was then replaced paid it again after every run.

The child is forked twice, so that it is the agent's child (the agent is its subreaper), not the
spare's: the agent waits for it, stops its process group and reads its exit code as for a process
it started itself, and it dies with the agent (PR_SET_PDEATHSIG, set once the agent is its
parent). What a fork inherits that a fresh process would not: the spare's interpreter state as
the import left it. Python's `random` is reseeded in every child (Python does it), NumPy's global
generator too (here), and `sys.path` starts with the run's working directory; the string hash seed
is the spare's; /proc/PID/environ shows the spare's environment (the run's identity is in the
run-named file the host process holds open).

Protocol (a SOCK_SEQPACKET socketpair; the spare's end is fd $TPULAUNCH_SPARE_FD): the spare sends
`{"ready": true}` once imported. A request is `{"state": PATH, "env": {...}, "cwd": DIR, "agent":
PID}` with four fds (stdout, stderr, Python's stdout, Python's stderr); the reply is `{"pid": N}`
or `{"error": "..."}`. When the agent closes its end, the spare exits.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time

from tpulaunch import procfs

FD_ENV = "TPULAUNCH_SPARE_FD"
READY = b'{"ready": true}'
ADOPT_TIMEOUT_S = 10.0  # a forked host waits this long to become the agent's child


class Spare:
    """The agent's side: a spare process with `framework` imported in the environment `env`."""

    def __init__(self, framework: str, env: dict[str, str], cwd: str) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            # its own output (an import's warnings, or why it failed) goes to the agent's Ray log
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "tpulaunch.host.bootstrap", "--spare", framework],
                env={**env, FD_ENV: str(theirs.fileno())}, cwd=cwd, stdin=subprocess.DEVNULL,
                start_new_session=True, preexec_fn=procfs.die_with_parent, pass_fds=[theirs.fileno()])
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        self.framework, self.env, self.sock = framework, env, ours
        self._ready = False

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def ready(self, timeout_s: float) -> bool:
        """Whether it has imported the framework, waiting up to `timeout_s` for it."""
        if not self._ready:
            self.sock.settimeout(timeout_s)
            try:
                self._ready = self.sock.recv(64) == READY
            except OSError:  # a timeout, or it is gone
                return False
        return self._ready

    def fork(self, state_path: str, env: dict[str, str], cwd: str, timeout_s: float) -> tuple[int, list[int]]:
        """A host process for one run: its pid (the agent's child) and the read ends of its four
        output pipes. Raises OSError when the spare cannot give one (not ready in time, gone)."""
        if not self.ready(timeout_s):
            raise OSError(f"the spare did not import {self.framework} within {timeout_s:g} s" if self.alive
                          else f"the spare exited ({procfs.exit_reason(procfs.exit_code(self.proc.returncode))})")
        pipes = [os.pipe() for _ in range(4)]
        request = {"state": state_path, "env": env, "cwd": cwd, "agent": os.getpid()}
        try:
            socket.send_fds(self.sock, [json.dumps(request).encode()], [w for _r, w in pipes])
            self.sock.settimeout(timeout_s)
            reply = json.loads(self.sock.recv(4096) or b'{"error": "the spare exited"}')
        except (OSError, ValueError) as e:
            reply = {"error": f"{type(e).__name__}: {e}"}
        finally:
            for _r, w in pipes:
                os.close(w)
        if "pid" not in reply:
            for r, _w in pipes:
                os.close(r)
            raise OSError(f"the spare could not fork: {reply.get('error')}")
        return int(reply["pid"]), [r for r, _w in pipes]

    def close(self, grace_s: float = 0.5) -> None:
        """Let it go: it exits when its end of the socket closes (killed if it does not in time)."""
        self.sock.close()
        try:
            self.proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            procfs.stop(lambda: [self.proc.pid] if self.proc.poll() is None else [], 0.5)
            self.proc.wait()


class Adopted:
    """A host process forked by a spare and re-parented to the agent: what the agent uses of a
    `subprocess.Popen` (`pid`, `poll`, `wait`, `returncode`) for a child it did not spawn itself.
    One thread waits for it, so no other waiter can take its exit code."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None
        self._done = threading.Event()
        threading.Thread(target=self._wait, name=f"tpulaunch-host-{pid}", daemon=True).start()

    def _wait(self) -> None:
        try:
            _pid, status = os.waitpid(self.pid, 0)
            self.returncode = os.waitstatus_to_exitcode(status)
        except ChildProcessError:  # not our child after all: nothing can say how it ended
            self.returncode = 255
        self._done.set()

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if not self._done.wait(timeout):
            raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout or 0.0)
        assert self.returncode is not None
        return self.returncode


# -- the spare's side ----------------------------------------------------------------------------


def serve(framework: str) -> list[str] | None:
    """Import `framework`, then fork a host process for every request. In the spare: returns None
    once the agent lets it go. In a host process it forked: returns the bootstrap's argv."""
    from tpulaunch.host import frameworks

    sock = socket.socket(fileno=int(os.environ.pop(FD_ENV)))
    frameworks.get(framework).preload()
    sock.send(READY)
    while True:
        try:
            msg, fds, _flags, _addr = socket.recv_fds(sock, 1 << 20, 4)
        except OSError:
            return None
        if not msg:
            return None
        argv = _fork(sock, json.loads(msg), fds)
        if argv is not None:
            return argv


def _fork(sock: socket.socket, request: dict, fds: list[int]) -> list[str] | None:
    """Fork twice: the host process (which returns its argv) ends up the agent's child."""
    if len(fds) != 4:
        for fd in fds:
            os.close(fd)
        sock.send(json.dumps({"error": f"{len(fds)} fds, not 4"}).encode())
        return None
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    r, w = os.pipe()
    middle = os.fork()
    if middle == 0:
        os.close(r)
        try:
            host = os.fork()
        except OSError:
            os._exit(1)
        if host == 0:
            os.close(w)
            return _become_host(sock, request, fds)
        os.write(w, str(host).encode())
        os._exit(0)
    os.close(w)
    for fd in fds:
        os.close(fd)
    os.waitpid(middle, 0)  # once it has exited, the host process is the agent's (its subreaper)
    with os.fdopen(r, "rb") as f:
        pid = f.read().strip()
    sock.send(json.dumps({"pid": int(pid)} if pid else {"error": "fork failed"}).encode())
    return None


def _become_host(sock: socket.socket, request: dict, fds: list[int]) -> list[str]:
    sock.close()
    os.setsid()  # a process group of its own, stopped as a whole, as a fresh host process is
    agent = int(request["agent"])
    deadline = time.monotonic() + ADOPT_TIMEOUT_S
    while os.getppid() != agent:  # its parent is exiting: it becomes the agent's
        if time.monotonic() > deadline:
            os._exit(70)
        time.sleep(0.001)
    procfs.die_with_parent()
    if os.getppid() != agent:  # the agent died before we could ask to die with it
        os._exit(70)
    out, err, py_out, py_err = fds
    from tpulaunch.host.context import PY_STDIO_ENV

    become_fresh(out, err, {**request["env"], PY_STDIO_ENV: f"{py_out},{py_err}"})
    was = os.getcwd()
    os.chdir(request["cwd"])
    if sys.path and sys.path[0] == was:  # `python -m` put the spare's working directory first: the run's
        sys.path[0] = os.getcwd()
    return [request["state"]]


def become_fresh(out: int, err: int, env: dict[str, str]) -> None:
    """In a forked child, what a fresh process would have: stdin from /dev/null, stdout and stderr on
    `out` and `err` (then closed), `env` as its whole environment, and NumPy's global generator
    seeded from the OS, not its parent's (Python reseeds `random` after a fork itself)."""
    null = os.open(os.devnull, os.O_RDONLY)
    for fd, target in ((null, 0), (out, 1), (err, 2)):
        os.dup2(fd, target)
        os.close(fd)
    os.environ.clear()
    os.environ.update(env)
    random = sys.modules.get("numpy.random")
    if random is not None:
        random.seed()
