"""`HostAgent`: one Ray actor per TPU host; it supervises the process that trains.

The actor reserves all of the host's chips (its placement-group bundle holds `TPU:
chips_per_host`), but never imports torch_xla or jax itself: it starts
`python -m tpulaunch.host.bootstrap` with the host's environment, so the runtime (and the chips) belong
to exactly one process whose exit code is the host's result, and which can be stopped as a
process group. The child gets `PR_SET_PDEATHSIG`, so if Ray kills the actor the child dies too.

The driver polls `poll()` for new output lines and the exit status; `terminate()` stops the
child (SIGTERM, then SIGKILL after a grace period).
"""

from __future__ import annotations

import collections
import ctypes
import os
import pickle
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

# Variables Ray sets for sub-host TPU allocations; the plan decides these, not the actor's parent.
_DROP = ("TPU_VISIBLE_CHIPS", "TPU_HOST_BOUNDS", "TPU_CHIPS_PER_HOST_BOUNDS", "RAY_ADDRESS")
_PR_SET_PDEATHSIG = 1
EXIT_TPU_BUSY = 87  # a leftover process holds this host's TPU (see `tpulaunch cluster doctor`)
PY_STDIO_ENV = "TPULAUNCH_PY_STDIO_FDS"  # "OUT,ERR": the fds the bootstrap gives sys.stdout / sys.stderr


def _die_with_parent() -> None:
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except OSError:
        pass


def exit_code_of(returncode: int) -> int:
    """Popen's `-N` (killed by signal N) becomes the shell's `128+N`."""
    return 128 - returncode if returncode < 0 else returncode


class HostAgent:
    """Supervisor of one host's training process. Used as a threaded Ray actor."""

    def __init__(self, process_index: int) -> None:
        self.process_index = process_index
        self._proc: subprocess.Popen | None = None
        self._lines: collections.deque = collections.deque()
        self._lock = threading.Lock()
        self._readers: list[threading.Thread] = []
        self._started = 0.0
        self._ended: float | None = None
        self._state_path: str | None = None
        self._refused: int | None = None

    def info(self) -> dict:
        """Where this agent landed: node labels decide its process index, not scheduling order."""
        import ray

        rc = ray.get_runtime_context()
        labels = rc.get_node_labels() if hasattr(rc, "get_node_labels") else {}
        return {
            "process_index": self.process_index,
            "node_id": rc.get_node_id(),
            "node_ip": ray.util.get_node_ip_address(),
            "hostname": socket.gethostname(),
            "labels": {k: (v[0] if isinstance(v, list) and v else v) for k, v in dict(labels).items()},
            "pid": os.getpid(),
        }

    def start(self, state: bytes, env: dict[str, str], command: list[str] | None = None,
              check_tpu: bool = False, kill_stale: bool = False, cwd: str | None = None) -> int:
        """Start the host process. `state` is the pickled HostState; returns the child's pid.

        With `check_tpu` (real TPU hosts), first make sure no leftover process holds the chips
        (the failure users hit most after an interrupted run); `kill_stale` clears them. `cwd` is
        where the script runs: the driver's working directory on emulated hosts (same filesystem),
        else the copy Ray shipped (this actor's own working directory).
        """
        if check_tpu and not self._tpu_free(kill_stale):
            self._ended = self._started = time.time()
            self._refused = EXIT_TPU_BUSY
            return -1
        fd, path = tempfile.mkstemp(prefix="tpulaunch-host-", suffix=".pkl")
        with os.fdopen(fd, "wb") as f:
            f.write(state)
        self._state_path = path
        child_env = {k: v for k, v in os.environ.items() if k not in _DROP}
        child_env.update(env)
        child_env["TPULAUNCH_STATE"] = path
        argv = command or [sys.executable, "-m", "tpulaunch.host.bootstrap", path]
        # The bootstrap writes Python's sys.stdout/sys.stderr to pipes of their own: native code
        # (gloo, XLA) writing to fds 1/2 at the same time could otherwise split a printed line.
        py_pipes = [] if command else [os.pipe(), os.pipe()]
        if py_pipes:
            child_env[PY_STDIO_ENV] = f"{py_pipes[0][1]},{py_pipes[1][1]}"
        self._started = time.time()
        try:
            self._proc = subprocess.Popen(
                argv, env=child_env, cwd=cwd or os.getcwd(), stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
                preexec_fn=_die_with_parent, bufsize=0, pass_fds=[w for _r, w in py_pipes],
            )
        except OSError as e:
            for r, w in py_pipes:
                os.close(r)
                os.close(w)
            self._push("stderr", f"tpulaunch: cannot start {argv[0]}: {e}")
            self._ended = time.time()
            return -1
        streams = [("stdout", self._proc.stdout), ("stderr", self._proc.stderr)]
        for name, (r, w) in zip(("stdout", "stderr"), py_pipes):
            os.close(w)
            streams.append((name, os.fdopen(r, "rb", buffering=0)))
        for name, stream in streams:
            t = threading.Thread(target=self._pump, args=(name, stream), daemon=True)
            t.start()
            self._readers.append(t)
        return self._proc.pid

    def _tpu_free(self, kill_stale: bool) -> bool:
        from tpulaunch.host import tpu_holders

        report = tpu_holders.scan()
        if report.clean:
            return True
        who = "; ".join(f"pid {h.pid} ({h.cmdline[:80]}) holds {', '.join(h.paths)}" for h in report.holders)
        what = who or f"stale lockfile {report.lockfile}"
        if not kill_stale:
            self._push("stderr", f"tpulaunch: the TPU on this host is busy: {what}. Rerun with --kill-stale to clear it")
            return False
        result = tpu_holders.clear(report)
        self._push("stderr", f"tpulaunch: --kill-stale: {what}; cleared {result}")
        return not result["failed"]

    def _push(self, stream: str, text: str) -> None:
        with self._lock:
            self._lines.append((stream, text))

    def _pump(self, name: str, stream) -> None:  # noqa: ANN001 - a binary pipe
        for raw in iter(stream.readline, b""):
            self._push(name, raw.decode("utf-8", "replace").rstrip("\r\n"))
        stream.close()

    def poll(self, max_lines: int = 2000) -> tuple[list[tuple[str, str]], int | None, float, float | None]:
        """New (stream, line) pairs, the exit code once ended and drained, wall time, and when it ended."""
        code = None
        if self._proc is None:
            code = (self._refused or 127) if self._ended else None
        elif self._proc.poll() is not None and not any(t.is_alive() for t in self._readers):
            code = exit_code_of(self._proc.returncode)
            self._ended = self._ended or time.time()
            self._remove_state()
        with self._lock:
            n = min(max_lines, len(self._lines))
            out = [self._lines.popleft() for _ in range(n)]
            if self._lines:
                code = None  # more to drain before reporting the end
        wall = (self._ended or time.time()) - self._started if self._started else 0.0
        return out, code, wall, self._ended

    def _remove_state(self) -> None:
        if self._state_path:
            try:
                os.unlink(self._state_path)
            except OSError:
                pass
            self._state_path = None

    def terminate(self, grace_s: float = 3.0) -> int | None:
        """Stop the host process group: SIGTERM, then SIGKILL after `grace_s`."""
        p = self._proc
        if p is None or p.poll() is not None:
            return None if p is None else exit_code_of(p.returncode)
        for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
            try:
                os.killpg(p.pid, sig)
            except ProcessLookupError:
                break
            try:
                p.wait(timeout=wait)
                break
            except subprocess.TimeoutExpired:
                continue
        for t in self._readers:
            t.join(timeout=2.0)
        return exit_code_of(p.returncode) if p.returncode is not None else None


def dumps_state(state: object) -> bytes:
    return pickle.dumps(state, protocol=pickle.HIGHEST_PROTOCOL)
