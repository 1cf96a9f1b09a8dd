"""`HostAgent`: one Ray actor per TPU host; it supervises the process that trains.

The actor reserves all of the host's chips (its placement-group bundle holds `TPU:
chips_per_host`), but never imports torch_xla or jax itself: it starts
`python -m tpulaunch.host.bootstrap` with the host's environment, so the runtime (and the chips)
belong to exactly one process whose exit code is the host's result, and which can be stopped as a
process group. The child gets `PR_SET_PDEATHSIG`, so if the actor dies (its node lost) the child
dies too, and `PR_SET_PTRACER` so the agent's `py-spy` may read its stacks.

The driver long-polls `poll()`: it returns as soon as there are new output lines or the process
ended, else after `wait_s`, with the time of the host's last sign of life (an output line or a
`tpulaunch.heartbeat()`). `terminate()` stops the child (SIGTERM, then SIGKILL after a grace
period); `dump_stacks()` is `py-spy dump` of the child.

Preemption: a SIGTERM to the agent (the VM shutting down) or a notice from the GCE metadata
server (`instance/preempted`, `instance/maintenance-event`; see `preemption.py`) is forwarded to
the script as SIGTERM with a grace period to save a checkpoint, and `poll()` reports the host as
preempted, so the driver counts a preemption rather than a failure.
"""

from __future__ import annotations

import collections
import ctypes
import os
import pickle
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

from tpulaunch.errors import ExitCode
from tpulaunch.host.context import HEARTBEAT_ENV

# Variables Ray sets for sub-host TPU allocations; the plan decides these, not the actor's parent.
_DROP = ("TPU_VISIBLE_CHIPS", "TPU_HOST_BOUNDS", "TPU_CHIPS_PER_HOST_BOUNDS", "RAY_ADDRESS")
_PR_SET_PDEATHSIG = 1
_PR_SET_PTRACER, _PR_SET_PTRACER_ANY = 0x59616D61, -1
EXIT_TPU_BUSY = ExitCode.TPU_BUSY  # a leftover process holds this host's TPU (see `tpulaunch cluster doctor`)
PY_STDIO_ENV = "TPULAUNCH_PY_STDIO_FDS"  # "OUT,ERR": the fds the bootstrap gives sys.stdout / sys.stderr


def _child_setup() -> None:
    """In the child, before exec: die with the agent; let a sibling py-spy trace us (Yama)."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        libc.prctl(_PR_SET_PTRACER, ctypes.c_ulong(_PR_SET_PTRACER_ANY & 0xFFFFFFFFFFFFFFFF), 0, 0, 0)
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
        self._cond = threading.Condition()
        self._readers: list[threading.Thread] = []
        self._started = 0.0
        self._ended: float | None = None
        self._last_line = 0.0
        self._state_path: str | None = None
        self._heartbeat: str | None = None
        self._refused: int | None = None
        self._preempted: str | None = None
        self._grace_s = 30.0
        if threading.current_thread() is threading.main_thread():
            # A threaded actor's __init__ runs on the worker's main thread: the one place a signal
            # handler can be installed. SIGTERM to this process is the host going away.
            signal.signal(signal.SIGTERM, self._on_sigterm)

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
              check_tpu: bool = False, kill_stale: bool = False, cwd: str | None = None,
              watch_preemption: bool = False, grace_s: float = 30.0) -> int:
        """Start the host process. `state` is the pickled HostState; returns the child's pid.

        With `check_tpu` (real TPU hosts), first make sure no leftover process holds the chips
        (the failure users hit most after an interrupted run); `kill_stale` clears them. `cwd` is
        where the script runs: the driver's working directory on emulated hosts (same filesystem),
        else the copy Ray shipped (this actor's own working directory). `watch_preemption` asks the
        metadata server for preemption notices; `grace_s` is how long a preempted script has.
        """
        self._grace_s = grace_s
        if check_tpu and not self._tpu_free(kill_stale):
            self._ended = self._started = time.time()
            self._refused = EXIT_TPU_BUSY
            return -1
        fd, path = tempfile.mkstemp(prefix="tpulaunch-host-", suffix=".pkl")
        with os.fdopen(fd, "wb") as f:
            f.write(state)
        self._state_path = path
        fd, self._heartbeat = tempfile.mkstemp(prefix="tpulaunch-heartbeat-")
        os.close(fd)
        child_env = {k: v for k, v in os.environ.items() if k not in _DROP}
        child_env.update(env)
        child_env["TPULAUNCH_STATE"] = path
        child_env[HEARTBEAT_ENV] = self._heartbeat
        argv = command or [sys.executable, "-m", "tpulaunch.host.bootstrap", path]
        # The bootstrap writes Python's sys.stdout/sys.stderr to pipes of their own: native code
        # (gloo, XLA) writing to fds 1/2 at the same time could otherwise split a printed line.
        py_pipes = [] if command else [os.pipe(), os.pipe()]
        if py_pipes:
            child_env[PY_STDIO_ENV] = f"{py_pipes[0][1]},{py_pipes[1][1]}"
        self._started = self._last_line = time.time()
        try:
            self._proc = subprocess.Popen(
                argv, env=child_env, cwd=cwd or os.getcwd(), stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
                preexec_fn=_child_setup, bufsize=0, pass_fds=[w for _r, w in py_pipes],
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
        threading.Thread(target=self._reap, daemon=True).start()
        if watch_preemption:
            from tpulaunch.host.preemption import watch

            watch(env.get("TPULAUNCH_METADATA_HOST") or None, self.preempt, stop=lambda: self._ended is not None)
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

    # -- output and the end ---------------------------------------------------------------------

    def _push(self, stream: str, text: str) -> None:
        with self._cond:
            self._lines.append((stream, text))
            self._last_line = time.time()
            self._cond.notify_all()

    def _pump(self, name: str, stream) -> None:  # noqa: ANN001 - a binary pipe
        for raw in iter(stream.readline, b""):
            self._push(name, raw.decode("utf-8", "replace").rstrip("\r\n"))
        stream.close()

    def _reap(self) -> None:
        """Wait for the child and its pipes; record when it ended and wake a waiting poll."""
        p = self._proc
        assert p is not None
        p.wait()
        for t in self._readers:
            t.join()
        with self._cond:
            self._ended = self._ended or time.time()
            self._cond.notify_all()
        self._cleanup_files()

    def _activity(self) -> float:
        beat = 0.0
        if self._heartbeat:
            try:
                beat = os.stat(self._heartbeat).st_mtime
            except OSError:
                pass
        return max(self._last_line, beat)

    def poll(self, max_lines: int = 5000, wait_s: float = 0.0) -> dict:
        """New output lines, and the end once every line is out. Waits up to `wait_s` for either.

        Returns {"lines": [(stream, text)], "code": exit code or None, "wall": seconds,
        "ended": when it ended (time.time) or None, "activity": last sign of life,
        "preempted": why, if this host was preempted}.
        """
        with self._cond:
            if wait_s > 0 and not self._lines and not self._done():
                self._cond.wait(wait_s)
            n = min(max_lines, len(self._lines))
            out = [self._lines.popleft() for _ in range(n)]
            code = self._code() if self._done() and not self._lines else None
        wall = (self._ended or time.time()) - self._started if self._started else 0.0
        return {"lines": out, "code": code, "wall": wall, "ended": self._ended if code is not None else None,
                "activity": self._activity(), "preempted": self._preempted}

    def _done(self) -> bool:
        if self._proc is None:
            return self._ended is not None
        return self._proc.returncode is not None and self._ended is not None

    def _code(self) -> int:
        if self._proc is None:
            return self._refused or 127
        return exit_code_of(self._proc.returncode)

    def _cleanup_files(self) -> None:
        for attr in ("_state_path", "_heartbeat"):
            path = getattr(self, attr)
            if path:
                try:
                    os.unlink(path)
                except OSError:
                    pass
                setattr(self, attr, None)

    # -- stopping -----------------------------------------------------------------------------

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

    def preempt(self, why: str) -> None:
        """This host is going away: give the script SIGTERM and the grace period, then SIGKILL."""
        if self._preempted is not None:
            return
        self._preempted = why
        self._push("stderr", f"tpulaunch: {why}: SIGTERM to the script, {self._grace_s:g} s to save and exit")
        threading.Thread(target=self.terminate, args=(self._grace_s,), daemon=True).start()

    def _on_sigterm(self, _signum: int, _frame: object) -> None:
        self.preempt("this host got SIGTERM (shutting down or preempted)")

    # -- where is it stuck --------------------------------------------------------------------

    def dump_stacks(self, timeout_s: float = 20.0) -> str:
        """`py-spy dump` of the host process: every Python thread's stack, innermost frame first."""
        p = self._proc
        if p is None or p.poll() is not None:
            return "(the host process had already ended)"
        exe = shutil.which("py-spy") or os.path.join(os.path.dirname(sys.executable), "py-spy")
        try:
            out = subprocess.run([exe, "dump", "--pid", str(p.pid)], capture_output=True, text=True, timeout=timeout_s)
        except (OSError, subprocess.TimeoutExpired) as e:
            return f"(py-spy dump failed: {e})"
        return out.stdout if out.returncode == 0 else f"(py-spy dump exited {out.returncode}: {out.stderr.strip()})"


def dumps_state(state: object) -> bytes:
    return pickle.dumps(state, protocol=pickle.HIGHEST_PROTOCOL)
