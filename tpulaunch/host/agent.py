"""`HostAgent`: one long-lived Ray actor per TPU host; it supervises the process that trains.

The agent is a named, detached actor on its host's Ray node (found again by the next run), holding
no resources itself: each run reserves the host's chips with its placement group. It never
imports torch_xla or jax: it starts `python -m tpulaunch.host.bootstrap` with the host's
environment, so the runtime (and the chips) belong to exactly one process whose exit code is the
host's result, and which can be stopped as a process group. The child gets `PR_SET_PDEATHSIG` (if
the agent dies, its node lost, the child dies too) and `PR_SET_PTRACER` (so py-spy may read it).

Warm hosts: after a run on a cluster that stays up, the agent keeps a *spare*: a bootstrap with
the framework imported, runtime untouched, that forks the host process of every later run with the
same environment (all but what `plan.env.split_env` calls per-run), so those runs skip the
interpreter start and the framework import (`spare.py`); any other run gets a fresh process.

The driver long-polls `poll()`: it returns as soon as there are new output lines or the process
ended, else after `wait_s`, with the time of the host's last sign of life (an output line or
`tpulaunch.heartbeat()`). A run whose driver stops polling for `DRIVER_GONE_S` is stopped:
no host outlives the launcher that supervises it. `terminate()` stops the child (SIGTERM, then
SIGKILL after a grace period); `dump_stacks()` is `py-spy dump` of it.

Preemption: SIGTERM to the agent (the VM shutting down) or a notice from the GCE metadata server
(`preemption.py`) is forwarded to the script as SIGTERM with a grace period to save a checkpoint,
and `poll()` reports the host as preempted, so the driver counts a preemption, not a failure.
"""

from __future__ import annotations

import json
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

from tpulaunch import procfs
from tpulaunch.errors import ExitCode
from tpulaunch.host import heartbeat
from tpulaunch.host.context import HEARTBEAT_ENV, TIMINGS_ENV
from tpulaunch.host.environment import NICENESS_ENV, package_path, run_files_dir, spare_env, start_env
from tpulaunch.host.process import HostProcess
from tpulaunch.host.protocol import (
    AgentInfo,
    HostOptions,
    HostRun,
    PollReply,
    PreflightReport,
    PreflightRequest,
    Started,
)
from tpulaunch.host.spare import Spare
from tpulaunch.plan.contract import HostState
from tpulaunch.plan.launch import run_marker

EXIT_TPU_BUSY = ExitCode.TPU_BUSY  # a leftover process holds this host's TPU (see `tpulaunch cluster doctor`)
DRIVER_GONE_S = 60.0  # a run nobody polled for this long has lost its driver
SPARE_WAIT_S = 60.0  # a run waits this long for a spare still importing its framework (then: a fresh process)
FORK_WAIT_S = 30.0  # ... and this long for a ready spare's fork
NAMESPACE = "tpulaunch"


def agent_name(slice_name: str, worker_id: int, code: str = "") -> str:
    return f"tpulaunch-agent-{slice_name}-{worker_id}" + (f"-{code}" if code else "")


def code_key() -> str:
    """Which copy of the user's code this driver's actors run in: the content hash Ray gives the
    working directory it ships ("" when nothing is shipped: emulated hosts run in place).

    A detached actor keeps the working directory of the job that started it, so an agent found
    again by a later run with other code would start the script in the old copy. Keyed by it, a
    run with the same code finds its warm agent, and one with other code starts a new one."""
    import re

    import ray

    uri = str((ray.get_runtime_context().runtime_env or {}).get("working_dir") or "")
    m = re.search(r"_ray_pkg_([0-9a-f]+)", uri)
    return m.group(1)[:16] if m else ""


def _is_code_key(text: str) -> bool:
    return len(text) == 16 and all(c in "0123456789abcdef" for c in text)


_RUN_PROBE = (f"import runpy; runpy.run_path({os.path.join(os.path.dirname(__file__), 'probe.py')!r},"
              " run_name='__main__')")


def agent_for(slice_name: str, worker_id: int) -> object:
    """The agent of TPU worker `worker_id` of `slice_name` for this driver's code: found, or
    started on that host's node."""
    import ray

    from tpulaunch.discover.ray_labels import SLICE, WORKER

    return ray.remote(HostAgent).options(
        name=agent_name(slice_name, worker_id, code_key()), namespace=NAMESPACE, get_if_exists=True,
        lifetime="detached", num_cpus=0, max_concurrency=8, max_restarts=0,
        label_selector={SLICE: slice_name, WORKER: str(worker_id)},
        # Ray starts its workers at nice 15, and the host process would inherit it: every other
        # process on the host would preempt the training loop (steps 1.4x slower on 2 cores).
        # Ray Jobs' driver supervisor gets nice 0 the same way.
        runtime_env={"env_vars": {NICENESS_ENV: "0"}},
    ).remote(slice_name, worker_id)


def warm_agents(hosts: list[tuple[str, int]]) -> int:
    """Start the agents of these hosts (a spare slice's) for this driver's code, without waiting for
    them: Ray starts each one's worker process now, not when the spare steps in for a lost slice,
    where it took about a second and a half of the swap on a 2-core machine. Best effort: one Ray
    would not start now starts when its host is used. Returns how many were asked (none when this
    process is not connected to Ray: Ray would start a cluster of its own to answer)."""
    import ray

    if not ray.is_initialized():
        return 0
    try:
        retire_other_agents(hosts)  # an earlier run's code's agents on these hosts, if idle
    except Exception:  # Ray's answer: they stay until the host is used, as before
        pass
    asked = 0
    for slice_name, worker_id in hosts:
        try:
            agent_for(slice_name, worker_id)  # creating the handle schedules the actor; nothing to wait for
            asked += 1
        except Exception:  # Ray's refusal or a lost connection: the swap starts it instead
            pass
    return asked


def retire_other_agents(hosts: list[tuple[str, int]]) -> int:
    """Ask the agents of these hosts that serve other code (an earlier run's) to exit if idle:
    their spares hold memory, and only the current code's agent is used again. Returns how many
    were asked (fire and forget)."""
    import ray

    mine = {agent_name(s, w, code_key()) for s, w in hosts}
    prefixes = tuple(agent_name(s, w) for s, w in hosts)
    asked = 0
    for a in ray.util.list_named_actors(all_namespaces=True):
        name = a["name"]
        if a["namespace"] != NAMESPACE or name in mine:
            continue
        if any(name == p or _is_code_key(name[len(p) + 1:]) and name.startswith(p + "-") for p in prefixes):
            try:
                ray.get_actor(name, namespace=NAMESPACE).retire.remote()
                asked += 1
            except ValueError:  # gone meanwhile
                pass
    return asked


class HostAgent:
    """Supervisor of one host's training processes, run after run. Used as a threaded Ray actor."""

    def __init__(self, slice_name: str, worker_id: int) -> None:
        self.slice_name, self.worker_id = slice_name, worker_id
        self._host: HostProcess | None = None
        self._refused: int | None = None
        self._run_id: str | None = None
        self._state: HostState | None = None  # the run of the host process started last
        self._files: list[str] = []
        self._heartbeat: str | None = None
        self._timings: str | None = None
        self._preempted: str | None = None
        self._grace_s = 30.0
        self._last_poll = time.time()
        self._spares: dict[str, Spare] = {}  # by framework
        self._notes: list[str] = []  # tpulaunch's own lines for the next poll (a busy TPU)
        self._helpers: set[int] = set()  # short-lived children of ours (py-spy): never a host's leftover
        self._lock = threading.Lock()
        self._subreaper = procfs.become_subreaper()  # what a host's script leaves (even after setsid) stays below us
        if threading.current_thread() is threading.main_thread():
            # A threaded actor's __init__ runs on the worker's main thread: the one place a signal
            # handler can be installed. SIGTERM to this process is the host going away.
            signal.signal(signal.SIGTERM, self._on_sigterm)
        threading.Thread(target=self._watch_driver, name="tpulaunch-driver-watch", daemon=True).start()

    def info(self) -> AgentInfo:
        """Where this agent lives: node labels decide its process index, not scheduling order."""
        import ray

        rc = ray.get_runtime_context()
        labels = rc.get_node_labels() if hasattr(rc, "get_node_labels") else {}
        return AgentInfo(
            node_id=rc.get_node_id(), node_ip=ray.util.get_node_ip_address(), hostname=socket.gethostname(),
            labels={k: (v[0] if isinstance(v, list) and v else v) for k, v in dict(labels).items()},
            pid=os.getpid(), spares=tuple(sorted(self._spares)), run=self._serving(),
        )

    def _serving(self) -> HostRun | None:
        st, h = self._state, self._host
        if st is None or h is None or not h.alive:
            return None
        return HostRun(st.run_id, st.attempt, st.process_index, st.mesh.num_slices * st.job.topology.num_hosts,
                       st.job.log_dir)

    # -- a run ----------------------------------------------------------------------------------

    def start(self, state: HostState, options: HostOptions) -> Started:
        """Start the host process `state` describes (a script, or `exec`'s command).

        With `options.check_tpu` (real TPU hosts), first make sure no leftover process holds the
        chips (the failure users hit most after an interrupted run); `kill_stale` clears them.
        A spare with the same environment forks the host process if there is one.
        """
        with self._lock:
            self._end_leftover()
            run_id = state.run_id
            self._run_id, self._grace_s, self._preempted, self._refused = run_id, options.preemption_grace_s, None, None
            self._state = state
            self._last_poll = time.time()
            if options.check_tpu and not self._tpu_free(options.kill_stale):
                self._refused = EXIT_TPU_BUSY
                return Started(-1, False, "the TPU is busy")
            where = run_files_dir()
            fd, path = tempfile.mkstemp(prefix="tpulaunch-host-", suffix=".pkl", dir=where)
            with os.fdopen(fd, "wb") as f:
                f.write(dumps_state(state))
            # Named for the run: every host process keeps it open, so /proc shows whose it is even
            # for one a spare forked, whose environment (/proc/<pid>/environ) is the spare's.
            fd, self._heartbeat = tempfile.mkstemp(prefix=f"{run_marker(run_id)}host{state.process_index}-", dir=where)
            os.close(fd)
            fd, self._timings = tempfile.mkstemp(prefix="tpulaunch-timings-", dir=where)
            os.close(fd)
            self._files = [path, self._heartbeat, self._timings]
            base, per_run = start_env(state)
            per_run.update({"TPULAUNCH_STATE": path, HEARTBEAT_ENV: self._heartbeat, TIMINGS_ENV: self._timings})
            cwd = options.cwd or os.getcwd()
            command = list(state.job.command)
            python = state.job.python
            env = {**base, **per_run}
            if command or python:
                spare, why = None, "a command, not a script" if command else "--python: the script's own interpreter"
            else:
                spare, why = self._spare_for(state)
            try:
                self._host = None
                if spare is not None:
                    try:
                        self._host = HostProcess.fork(spare, path, env, cwd, FORK_WAIT_S, leftovers=self._leftovers)
                    except OSError as e:  # a fresh process instead; the spare is let go
                        self._spares.pop(spare.framework, None)
                        spare.close()
                        spare, why = None, str(e)
                if self._host is None:
                    argv = command or [python or sys.executable, "-m", "tpulaunch.host.bootstrap", path]
                    if python:  # the bootstrap runs from this tpulaunch, nothing else of this environment
                        env["PYTHONPATH"] = os.pathsep.join(filter(None, (package_path(), env.get("PYTHONPATH"))))
                    self._host = HostProcess.spawn(argv, env, cwd, leftovers=self._leftovers)
                self._host.keep_children = options.keep_children
            except OSError as e:
                self._host = None
                self._refused = ExitCode.CANNOT_START
                self._notes.append(f"tpulaunch: cannot start {' '.join(command) or 'the bootstrap'}: {e.strerror or e}")
                self._cleanup_files()
                return Started(-1, False, f"cannot start {' '.join(command) or 'the bootstrap'}: {e.strerror or e}")
            if options.watch_preemption:
                from tpulaunch.host.preemption import watch

                host = self._host
                watch(options.metadata_host, self.preempt, stop=lambda: host.done())
            return Started(self._host.proc.pid, spare is not None, why)

    def preflight(self, state: HostState, options: HostOptions, request: PreflightRequest) -> PreflightReport:
        """Check this host before its script may start: what its process would see (run in its own
        environment and working directory), who this node says it is, whether its TPU is free (a
        real TPU host's)."""
        import ray

        from tpulaunch.host import tpu_holders

        base, per_run = start_env(state)
        env = {**base, **per_run}
        doc = {"script": state.job.script or None, "cache_dir": state.job.compile_cache, "log_dir": state.job.log_dir,
               "connect": [list(c) for c in request.connect], "bind": [list(b) for b in request.bind],
               "timeout_s": request.timeout_s}
        probe, error = {}, None
        try:
            cwd = options.cwd or os.getcwd()
        except FileNotFoundError:
            cwd, error = None, "its working directory (this host's copy of the run's code) was deleted"
        if cwd is not None:
            try:
                # the probe's file, not `-m tpulaunch.host.probe`: the package's imports are not what is
                # checked, and on 32 emulated hosts sharing 2 cores they were a fifth of preflight
                proc = subprocess.run([sys.executable, "-c", _RUN_PROBE, json.dumps(doc)], env=env,
                                      cwd=cwd, capture_output=True, text=True,
                                      timeout=30 + request.timeout_s * max(1, len(request.connect)))
                if proc.returncode == 0:
                    probe = json.loads(proc.stdout.strip().splitlines()[-1])
                else:
                    error = f"the probe exited {proc.returncode}: {(proc.stderr.strip().splitlines() or [''])[-1]}"
            except (OSError, ValueError, IndexError, subprocess.TimeoutExpired) as e:
                error = f"the probe failed: {type(e).__name__}: {e}"
        rc = ray.get_runtime_context()
        # a label's value: a list of one (as Ray annotates it) or a string, which str() leaves as it is
        labels = {k: (v[0] if isinstance(v, list) and v else str(v)) for k, v in dict(rc.get_node_labels()).items()}
        # An emulated host holds no TPU: a process with this machine's libtpu lockfile open (a real
        # TPU job on the VM a slice is emulated on) takes nothing from it. Real hosts only, as at start.
        report = tpu_holders.scan() if not state.emulated else tpu_holders.HoldersReport(devices=[])
        holders = tuple(f"pid {h.pid} ({h.cmdline[:60]})" for h in report.holders)
        return PreflightReport(
            process_index=state.process_index, probe=probe, node_worker_id=os.environ.get("TPU_WORKER_ID"),
            label_worker_id=labels.get("ray.io/tpu-worker-id"), label_slice=labels.get("ray.io/tpu-slice-name"),
            metadata_worker_id=self._metadata_worker_id(options) if not state.emulated else None,
            tpu_holders=holders, stale_lockfile=report.lockfile if report.lockfile_stale else None, error=error)

    @staticmethod
    def _metadata_worker_id(options: HostOptions) -> str | None:
        """agent-worker-number from this VM's metadata server (a TPU VM), quickly or not at all."""
        from tpulaunch.discover.metadata import MetadataClient
        from tpulaunch.errors import MetadataError

        try:
            client = MetadataClient(host=options.metadata_host, timeout=1.0)
            return client.get("instance/attributes/agent-worker-number")
        except (MetadataError, OSError):
            return None

    def _spare_for(self, state: HostState) -> tuple[Spare | None, str]:
        """This host's spare for `state`'s run, ready to fork it, or why there is none. A spare of
        another environment stays: the run after this one may share it again."""
        framework = state.framework
        spare = self._spares.get(framework)
        if spare is None:
            return None, f"no spare with {framework} imported"
        if not spare.alive:
            self._spares.pop(framework).close()
            return None, "the spare had exited"
        want = spare_env(state)
        if want != spare.env:
            keys = sorted(k for k in set(want) | set(spare.env) if want.get(k) != spare.env.get(k))
            return None, "the environment differs from the spare's in " + ", ".join(keys[:8])
        if not spare.ready(SPARE_WAIT_S):  # still importing: it had that long, more than a fresh start needs
            self._spares.pop(framework).close()
            return None, f"the spare had not imported {framework} within {SPARE_WAIT_S:g} s"
        return spare, "a spare with the same environment"

    def _tpu_free(self, kill_stale: bool) -> bool:
        from tpulaunch.host import tpu_holders

        report = tpu_holders.scan()
        if report.clean:
            return True
        who = "; ".join(f"pid {h.pid} ({h.cmdline[:80]}) holds {', '.join(h.paths)}" for h in report.holders)
        what = who or f"stale lockfile {report.lockfile}"
        if not kill_stale:
            self._notes.append(f"tpulaunch: the TPU on this host is busy: {what}. Rerun with --kill-stale to clear it")
            return False
        result = tpu_holders.clear(report)
        self._notes.append(f"tpulaunch: --kill-stale: {what}; cleared {result}")
        return not result["failed"]

    def poll(self, max_lines: int = 5000, wait_s: float = 0.0, batch_s: float = 0.0) -> PollReply:
        """New output lines, and the end once every line is out. Waits up to `wait_s` for either;
        with `batch_s`, lines that arrive within `batch_s` of the call come in the same reply (many
        hosts: fewer, fuller replies), while the end of the process still answers at once."""
        t0 = time.monotonic()
        self._last_poll = time.time()
        notes, self._notes = [("stderr", n) for n in self._notes], []
        h = self._host
        if h is None:
            code = self._refused
            now = time.time()
            return PollReply(lines=tuple(notes), code=code, wall_s=0.0, ended=now if code is not None else None,
                             activity=now, preempted=self._preempted)
        with h.cond:
            if wait_s > 0 and not h.lines and not h.done():
                h.cond.wait(wait_s)
            rest = t0 + batch_s - time.monotonic()
            if rest > 0 and h.lines:
                h.cond.wait_for(lambda: h.done() or len(h.lines) >= max_lines, timeout=rest)
            n = min(max_lines, len(h.lines))
            out = notes + [h.lines.popleft() for _ in range(n)]
            code = h.code() if h.done() and not h.lines else None
        phases = {}
        steps = self._step()  # before the files go: the last reply carries the last step too
        activity = self._activity(h)
        if code is not None:
            phases = self._phases()
            self._cleanup_files()
        return PollReply(lines=tuple(out), code=code, wall_s=(h.exited or time.time()) - h.started,
                         ended=h.exited if code is not None else None, activity=activity,
                         preempted=self._preempted, phases=phases, **steps)

    def _phases(self) -> dict:
        try:
            with open(self._timings or "") as f:
                return json.load(f)
        except (OSError, ValueError):
            return {}

    def _activity(self, h: HostProcess) -> float:
        beat = 0.0
        if self._heartbeat:
            try:
                beat = os.stat(self._heartbeat).st_mtime
            except OSError:
                pass
        return max(h.last_line, beat)

    def _step(self) -> dict:
        """What the script last said with `tpulaunch.heartbeat(step=N)`: the PollReply's step fields."""
        beat = heartbeat.read(self._heartbeat or "")
        return beat.reply_fields() if beat else {}

    def release(self, prewarm: HostState | None = None) -> None:
        """The run is over: stop what is left of it; with `prewarm`, start a spare for the next
        run like it (on a cluster that stays up)."""
        with self._lock:
            self._end_leftover()
            self._run_id = None
        if prewarm is not None and not prewarm.job.command:
            self.prewarm(prewarm)

    def retire(self) -> bool:
        """Exit (with the spares) unless a host process runs: a newer run's code has its own agent."""
        import ray

        with self._lock:
            if self._host is not None and self._host.alive:
                return False
            for spare in self._spares.values():
                spare.close()
            self._spares.clear()
        ray.actor.exit_actor()
        return True

    def prewarm(self, state: HostState) -> bool:
        """Keep a spare with `state`'s framework imported in the environment runs like it share: the
        one there is if it has that environment, else a new one (the other let go)."""
        framework = state.framework
        if state.job.python or not self._subreaper:  # another interpreter; or forks we could not wait for
            return False
        env0 = spare_env(state)
        old = self._spares.get(framework)
        if old is not None and old.env == env0 and old.alive:
            return True
        if old is not None:
            self._spares.pop(framework).close()
        try:
            self._spares[framework] = Spare(framework, env0, os.getcwd())
        except OSError:
            return False
        return True

    def _leftovers(self, host: HostProcess) -> list[int]:
        """Processes `host`'s script left behind once its own process ended.

        This agent is a child subreaper, so whatever the script started (forked, daemonized,
        `setsid` too) is re-parented below it when its parent dies: everything below the agent is
        the script's, except the spares (and theirs), other host processes and our own helpers (py-spy). Only where the
        kernel refused us that role (orphans go to init) are they found by the run's and host's
        identity in their environment, a read of every process on the machine.
        """
        with HostProcess.spawning:
            kids = procfs.subtree(os.getpid())
            keep = set(self._helpers)
            others = (HostProcess.running - {host.proc.pid}) | {s.pid for s in list(self._spares.values())}
            for pid in others:  # the spares, the next run's host
                keep |= {pid, *procfs.descendants(pid, kids)}
            found = set(procfs.descendants(os.getpid(), kids))
        run, index = host.env.get("TPULAUNCH_RUN_ID"), host.env.get("TPULAUNCH_PROCESS_INDEX")
        if run and not self._subreaper:  # orphans went to init: find them by the environment they inherited
            mark = {f"TPULAUNCH_RUN_ID={run}".encode(), f"TPULAUNCH_PROCESS_INDEX={index}".encode()}
            found |= {proc.pid for proc in procfs.processes() if mark <= set(proc.environ().split(b"\0"))}
        return sorted(p for p in found - keep if p != host.proc.pid and procfs.alive(p))

    def _reap_orphans(self) -> None:
        """Orphans re-parented to us (we are their subreaper) are ours to wait for, once they end;
        never a child a Popen of ours (or an `Adopted`'s thread) waits for (its exit code would be
        lost). Under the spawning lock: a host process a spare just forked is ours before we look (a
        host process is in `HostProcess.running` until its waiter has reaped it)."""
        with HostProcess.spawning:
            managed = {s.pid for s in list(self._spares.values())} | set(self._helpers) | HostProcess.running
            me = os.getpid()
            kids = procfs.child_pids(me)  # every 5 s on every host: its own children, not all of /proc
            found = (procfs.Process(p) for p in kids) if kids is not None else procfs.processes()
            for proc in found:
                if proc.pid not in managed and proc.state() == "Z" and proc.ppid() == me:
                    try:
                        os.waitpid(proc.pid, os.WNOHANG)
                    except ChildProcessError:
                        pass

    def _end_leftover(self) -> None:
        if self._host is not None and self._host.alive:
            self._host.push("stderr", "tpulaunch: stopping this host's process (its run is over)")
            self._host.terminate(3.0)
        self._host = None
        self._cleanup_files()

    def _cleanup_files(self) -> None:
        for path in self._files:
            try:
                os.unlink(path)
            except OSError:
                pass
        self._files = []

    def _watch_driver(self) -> None:
        """A run nobody polls (its driver killed, its head node gone) is stopped, not left running."""
        while True:
            time.sleep(5.0)
            self._reap_orphans()
            h = self._host
            if h is not None and h.alive and time.time() - self._last_poll > DRIVER_GONE_S:
                h.push("stderr", f"tpulaunch: nobody polled this host for {DRIVER_GONE_S:.0f} s (its launcher is"
                                 " gone): stopping it")
                h.terminate(self._grace_s)

    # -- stopping -----------------------------------------------------------------------------

    def terminate(self, grace_s: float = 3.0) -> int | None:
        """Stop the host process group: SIGTERM, then SIGKILL after `grace_s`."""
        h = self._host
        return None if h is None else h.terminate(grace_s)

    def preempt(self, why: str) -> None:
        """This host is going away: give the script SIGTERM and the grace period, then SIGKILL."""
        h = self._host
        if self._preempted is not None or h is None or not h.alive:
            return
        self._preempted = why
        h.push("stderr", f"tpulaunch: {why}: SIGTERM to the script, {self._grace_s:g} s to save and exit")
        threading.Thread(target=h.terminate, args=(self._grace_s,), daemon=True).start()

    def _on_sigterm(self, _signum: int, _frame: object) -> None:
        self.preempt("this host got SIGTERM (shutting down or preempted)")

    # -- where is it stuck --------------------------------------------------------------------

    def dump_stacks(self, timeout_s: float = 20.0) -> str:
        """`py-spy dump` of the host process and its children (a torch_tpu host's one per device):
        every Python thread's stack, innermost frame first."""
        h = self._host
        if h is None or not h.alive:
            return "(the host process had already ended)"
        exe = shutil.which("py-spy") or os.path.join(os.path.dirname(sys.executable), "py-spy")
        try:
            with HostProcess.spawning:  # a leftover sweep never sees it unnamed
                proc = subprocess.Popen([exe, "dump", "--subprocesses", "--pid", str(h.proc.pid)],
                                        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                self._helpers.add(proc.pid)
        except OSError as e:
            return f"(py-spy dump failed: {e})"
        try:
            out, err = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
            return f"(py-spy dump took longer than {timeout_s:g} s)"
        finally:
            self._helpers.discard(proc.pid)
        return out if proc.returncode == 0 else f"(py-spy dump exited {proc.returncode}: {err.strip()})"


def dumps_state(state: HostState) -> bytes:
    return pickle.dumps(state, protocol=pickle.HIGHEST_PROTOCOL)
