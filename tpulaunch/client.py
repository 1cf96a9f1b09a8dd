"""tpulaunch as a Python library: submit runs to a cluster, watch them, stop them.

In the habits of Ray's `JobSubmissionClient` and SkyPilot's SDK::

    import tpulaunch
    client = tpulaunch.Client("auto")                   # or "HOST:PORT", "http://DASHBOARD"
    run = client.submit("train.py", topology="2x4", args=["--steps", "3"], env={"WANDB_API_KEY": key})
    run.id; run.status().state                         # a tpulaunch.RunState: PENDING, RUNNING, SUCCEEDED, ...
    for line in run.logs(follow=True): print(line)     # every host's prefixed lines
    code = run.wait(timeout=600)                       # the run's exit code, as `tpulaunch wait` gives it
    run.summary().attempts                             # what it ended with (`summary.json`), typed
    run.stop(); client.runs()                          # newest first
    summary = tpulaunch.launch("train.py", topology="2x4")   # foreground here; a RunSummary

The cluster is found as the CLI finds it (`auto`: the one `tpulaunch cluster up` recorded here,
with its token). Runs go through the same code as `tpulaunch run --detach` (`run.runner`): checked
as the CLI checks them, then the supervisor is a Ray job on the head; the request (env values
included) is stored behind the cluster's token and never on a command line. Errors are
`tpulaunch.errors`' classes, each with the exit code the CLI would give (`e.exit_code`), never
`SystemExit`.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any

from tpulaunch.errors import TpulaunchError, WaitTimeout
from tpulaunch.run.status import HostPhase, RunState
from tpulaunch.run.summary import RunSummary

if TYPE_CHECKING:
    from tpulaunch.cluster.record import ClusterInfo

__all__ = ["AttemptStatus", "Client", "HostStatus", "Run", "RunSpec", "RunStatus", "WaitTimeout", "launch"]


@dataclass(frozen=True)
class RunSpec:
    """What to run, as `tpulaunch run` takes it: a script in the working directory, its arguments,
    its environment (values never on a command line), the slice, and any other of `run`'s options by
    their `LaunchRequest` names (`framework`, `max_restarts`, `timeout`, `placement`, `workdir`, ...).

    Example::

        spec = tpulaunch.RunSpec("train.py", args=["--steps", "100"], topology="2x8",
                                 options={"max_restarts": 2, "framework": "jax"})
        run = tpulaunch.Client("auto").submit(spec)
    """

    script: str
    args: Sequence[str] = ()
    env: dict[str, str] | None = None
    topology: str | None = None
    accelerator: str | None = None
    num_slices: int | None = None
    mesh: str | None = None
    dcn: str | None = None
    options: dict[str, Any] | None = None


@dataclass(frozen=True)
class HostStatus:
    """One host of a run, as its supervisor last said (`tpulaunch status RUN`)."""

    process_index: int
    slice_index: int
    worker_id: int
    state: HostPhase
    exit_code: int | None = None
    since_last_s: float | None = None  # seconds since its last line or heartbeat
    last_line: str = ""
    reason: str | None = None
    step: int | None = None
    step_rate: float | None = None

    def to_dict(self) -> dict:
        return {**{f.name: getattr(self, f.name) for f in fields(self)}, "state": str(self.state)}


@dataclass(frozen=True)
class AttemptStatus:
    """One attempt of a run: how it ended, what ended it, and what recovery did after it."""

    index: int
    outcome: str  # ok, failed, lost, preempted, timeout, stalled, interrupted, preflight, grown
    exit_code: int | None = None
    who: str | None = None  # what ended it, in a few words
    log_dir: str = ""
    reason: str = "first"  # why it ran: first, restart, preemption, shrink, grow
    slices: tuple[str, ...] = ()
    recreated: tuple[dict, ...] = ()  # slices made again after it (`--recreate`)
    hang: dict | None = None  # a stall's triage: culprits, where, others, line, slices
    replaced: tuple[dict, ...] = ()  # slices swapped out after it (spares, `--replace-hung`)

    @staticmethod
    def of(d: dict) -> AttemptStatus:
        return AttemptStatus(d["index"], d["outcome"], d.get("exit_code"), d.get("who"), d.get("log_dir", ""),
                             d.get("reason", "first"), tuple(d.get("slices") or ()), tuple(d.get("recreated") or ()),
                             d.get("hang"), tuple(d.get("replaced") or ()))

    def to_dict(self) -> dict:
        d: dict[str, Any] = {"index": self.index, "outcome": self.outcome, "exit_code": self.exit_code, "who": self.who,
                             "log_dir": self.log_dir, "reason": self.reason, "slices": list(self.slices)}
        for key in ("recreated", "replaced"):
            if getattr(self, key):
                d[key] = list(getattr(self, key))
        if self.hang is not None:
            d["hang"] = self.hang
        return d


@dataclass(frozen=True)
class RunStatus:
    """One run as the cluster knows it (what `tpulaunch status RUN --json` prints)."""

    run_id: str
    state: RunState
    script: str = ""
    attempt: int | None = None
    exit_code: int | None = None
    started: float | None = None
    ended: float | None = None
    message: str | None = None
    hosts: tuple[HostStatus, ...] = ()
    attempts: tuple[AttemptStatus, ...] = ()
    note: str | None = None

    @property
    def terminal(self) -> bool:
        """The run has ended (succeeded, failed, stopped, or its supervisor is gone)."""
        return self.state.terminal

    def to_dict(self) -> dict:
        """The `tpulaunch.run-status/v1` document (`tpulaunch status RUN --json`)."""
        now = time.time()
        return {"schema": "tpulaunch.run-status/v1", "run_id": self.run_id, "script": self.script,
                "state": self.state.value, "attempt": self.attempt, "exit_code": self.exit_code,
                "started": self.started, "ended": self.ended,
                "duration_s": (self.ended or now) - self.started if self.started else None,
                "message": self.message, "hosts": [h.to_dict() for h in self.hosts],
                "attempts": [a.to_dict() for a in self.attempts], "note": self.note}

    @staticmethod
    def of(rec: Any) -> RunStatus:  # rec: detached.RunRecord
        j, v = rec.job, rec.view
        now = time.time()
        hosts = tuple(HostStatus(h.process_index, h.slice_index, h.worker_id, h.phase, h.exit_code,
                                 None if not h.last_activity else round(now - h.last_activity, 1), h.last_line,
                                 h.reason, h.step, h.step_rate)
                      for h in (v.hosts if v else ()))
        state: RunState = rec.state
        return RunStatus(rec.run_id, state, j.metadata.get("script", ""), v.attempt if v else None, rec.exit_code,
                         j.start_time, j.end_time, j.message if state in (RunState.FAILED, RunState.LOST) else None,
                         hosts, tuple(AttemptStatus.of(a) for a in (v.attempts if v else ())), v.note if v else None)


class Run:
    """A handle on one run of a cluster (cheap: it holds the id; every call asks the cluster)."""

    def __init__(self, client: Client, run_id: str) -> None:
        self._client = client
        self.id = run_id

    def __repr__(self) -> str:
        return f"Run({self.id!r})"

    def _job(self) -> Any:
        from tpulaunch.run import detached

        return detached.find(self._client._api(), self.id)

    def status(self) -> RunStatus:
        """Where the run is now.

        Returns:
            The run's `RunStatus` (state, attempt, each host, each attempt so far).

        Raises:
            ClusterError: the cluster does not answer, or has no run by this id.

        Example::

            while not run.status().terminal: time.sleep(5)
        """
        from tpulaunch.run import detached

        return RunStatus.of(detached.record(self._client._api(), self._job()))

    def logs(self, follow: bool = False, *, host: int | None = None, attempt: int | None = None) -> Iterator[str]:
        """The run's lines, as `tpulaunch logs` prints them.

        Args:
            follow: keep reading until the run ends.
            host: one host's whole log instead of every host's prefixed lines (`[host i] ...`).
            attempt: with `host`, that attempt's log (default: the latest).

        Yields:
            One line at a time, without its newline.

        Raises:
            TpulaunchError: the run (or that host's log) has no log on the head (exit code 2).
            ClusterError: the cluster does not answer.

        Example::

            for line in run.logs(follow=True): print(line)
        """
        from tpulaunch.run import detached

        api = self._client._api()
        if host is None:
            chunks = (detached.follow_driver_log(api, self.id, require_log=True) if follow
                      else iter([detached.driver_output(api, self._job())]))
        else:
            chunks = detached.follow_host_log(api, self._job(), host, attempt, follow)
        pending = ""
        for chunk in chunks:
            pending += chunk
            *lines, pending = pending.split("\n")
            yield from lines
        if pending:
            yield pending

    def wait(self, timeout: float | None = None, poll_s: float = 1.0) -> int:
        """Block until the run ends.

        Args:
            timeout: seconds to wait at most (None: as long as it takes).
            poll_s: seconds between two looks at the run.

        Returns:
            The run's exit code (`docs/exit_codes.rst`): 0 when every host exited 0.

        Raises:
            WaitTimeout: the run was still going after `timeout` seconds (exit code 124).
            TpulaunchError: `timeout` is not a positive number (exit code 2).

        Example::

            if run.wait(timeout=3600) != 0: print(run.status().attempts[-1].who)
        """
        from tpulaunch.run import detached

        if timeout is not None and not timeout > 0:
            raise TpulaunchError(f"timeout {timeout!r} is not a positive number of seconds", "e.g. timeout=3600")
        rec = detached.wait(self._client._api(), self.id, timeout, poll_s)
        if not rec.job.terminal:
            raise WaitTimeout(f"run {self.id} is still {rec.state} after {timeout:g} s", "wait again, or stop it")
        return rec.exit_code if rec.exit_code is not None else 1

    def summary(self) -> RunSummary:
        """What an ended run produced: its `summary.json`, read from the head.

        Returns:
            The `RunSummary`: exit code, outcome, every attempt with every host's result.

        Raises:
            TpulaunchError: the run has not ended, or the head has no summary of it (exit code 2).

        Example::

            s = run.summary(); print(s.exit_code, [a.outcome for a in s.attempts])
        """
        import json

        from tpulaunch.run import detached

        api, job = self._client._api(), self._job()
        text = api.read_file(job.driver_node_id, str(detached.run_paths(job.submission_id).summary)) \
            if job.driver_node_id else None
        if not text:
            raise TpulaunchError(f"run {self.id} has no summary on the cluster's head" + (
                "" if job.terminal else " yet: it has not ended"), f"`tpulaunch status {self.id}` says where it is")
        try:
            return RunSummary.from_dict(json.loads(text))
        except (ValueError, KeyError, TypeError) as e:
            raise TpulaunchError(f"run {self.id}'s summary cannot be read: {e}",
                                 "it was written by another tpulaunch version") from None

    def stop(self) -> RunStatus:
        """Stop the run as SIGTERM stops a foreground one: every host stopped, logs kept.

        Returns:
            Its `RunStatus` once it has ended (`STOPPED`, exit code 143), or as it was if it had ended.

        Raises:
            ClusterError: the cluster does not answer.

        Example::

            run.stop().exit_code  # 143
        """
        from tpulaunch.run import detached

        api = self._client._api()
        job = self._job()
        if not job.terminal:
            api.stop(job.submission_id)
        return RunStatus.of(detached.wait(api, job.submission_id, detached.STOP_WAIT_S + 30))


class Client:
    """A cluster's runs, found as the CLI finds the cluster.

    Args:
        address: `auto` (the cluster `tpulaunch cluster up` recorded here, or `RAY_ADDRESS`),
            `HOST:PORT`, or the dashboard's `http://HOST:PORT`. The token is the cluster's own.

    Raises:
        TpulaunchError: no cluster is given or recorded (exit code 2).
        ClusterError: `auto` found no running cluster (exit code 5).
        StateError: the cluster's record here cannot be used (exit code 6).

    Example::

        client = tpulaunch.Client("auto")
        run = client.submit("train.py", topology="2x8", max_restarts=2)
    """

    def __init__(self, address: str = "auto") -> None:
        self.address = address
        self._cluster = _cluster(address)
        self._job_api: Any = None

    def _api(self) -> Any:
        from tpulaunch.run import detached

        if self._job_api is None:
            self._job_api = detached.job_api(self._cluster)
        return self._job_api

    def submit(self, script: str | RunSpec, *, args: Sequence[str] = (), env: Mapping[str, str] | None = None,
               topology: str | None = None, accelerator: str | None = None, num_slices: int | None = None,
               mesh: str | None = None, dcn: str | None = None, **options: Any) -> Run:
        """Submit a run to the cluster's head; returns at once.

        The request is checked here first as `tpulaunch run --detach` checks it (values, script,
        working directory, what `--recreate`/`--replace-hung` need of this cluster): what the CLI
        refuses, this refuses with the same line.

        Args:
            script: a `RunSpec`, or the script's path inside the working directory (`workdir`, default `.`).
            args: the script's arguments.
            env: environment for every host (stored behind the cluster's token, never on a command line).
            topology: the slice's shape, as `run --topology` (and `accelerator`, `num_slices`, `mesh`,
                `dcn` as their flags).
            options: `run`'s other flags by their `LaunchRequest` names (`framework`, `max_restarts`,
                `max_preemptions`, `recreate`, `timeout`, `stall_timeout`, `placement`, `workdir`, ...).

        Returns:
            A `Run` handle.

        Raises:
            TpulaunchError: a bad value, an unknown option, a missing script (exit code 2), or a
                recovery flag this cluster cannot honour; the subclass carries its exit code.
            ClusterError: the cluster's head does not answer (exit code 5).

        Example::

            run = client.submit("train.py", args=["--steps", "100"], topology="2x8", max_restarts=1)
            run = client.submit(tpulaunch.RunSpec("train.py", topology="2x8", options={"framework": "jax"}))
        """
        from tpulaunch.run import runner

        req = _request(_spec(script, args, env, topology, accelerator, num_slices, mesh, dcn, options),
                       self._cluster.address)
        where = runner.OnTheHead(self._cluster, runner.Target(self._cluster))
        checked, _ = where.check(req)
        return Run(self, where.submit(checked, self._api()))

    def run(self, run_id: str) -> Run:
        """A run of this cluster by id, or `last` (the newest).

        Args:
            run_id: the id `submit` returned (also in `tpulaunch runs`), or `last`.

        Returns:
            The run, to watch, wait for or stop; nothing is asked of the cluster until then.

        Raises:
            TpulaunchError: a malformed id (exit code 2).
            ClusterError: no such run on the cluster (exit code 5).

        Example::

            print(Client().run("last").status().state)
        """
        from tpulaunch.run import detached

        return Run(self, detached.find(self._api(), run_id).submission_id)

    def runs(self) -> list[Run]:
        """Every run tpulaunch submitted to the cluster, newest first.

        Raises:
            ClusterError: the cluster's job API cannot be reached or refuses the token (exit code 5).

        Example::

            for run in Client().runs():
                print(run.id, run.status().state)
        """
        from tpulaunch.run import detached

        return [Run(self, j.submission_id) for j in reversed(detached.runs(self._api()))]


def launch(script: str | RunSpec, *, args: Sequence[str] = (), env: Mapping[str, str] | None = None,
           topology: str | None = None, accelerator: str | None = None, num_slices: int | None = None,
           mesh: str | None = None, dcn: str | None = None, address: str | None = None, sink: Any = None,
           **options: Any) -> RunSummary:
    """Run a script in the foreground, as `tpulaunch run` does, and wait for its end.

    With no cluster (`address` None and no `RAY_ADDRESS`) the slice is emulated on this machine;
    on a cluster whose head is elsewhere the run goes there (as `Client.submit`) and this waits.

    The run's own keywords (`script`, `args`, `env`, the slice, the other options) are `Client.submit`'s.

    Args:
        address: the cluster, as `Client`'s (None: emulate here unless `RAY_ADDRESS` is set).
        sink: receives the hosts' lines and progress (default: printed as the CLI prints them in a pipe).

    Returns:
        The run's `RunSummary` (`.exit_code`, `.outcome`, `.hosts`, `.attempts`).

    Raises:
        TpulaunchError: as `Client.submit`, and what the launch itself raises (a cluster that cannot
            start: `ClusterError`, exit code 5).

    Example::

        summary = tpulaunch.launch("train.py", topology="2x8", args=["--steps", "10"])
        assert summary.exit_code == 0, summary.first_failure
    """
    from tpulaunch.run import runner

    spec = _spec(script, args, env, topology, accelerator, num_slices, mesh, dcn, options)
    req = _request(spec, address)
    where = runner.choose(req)
    if isinstance(where, runner.OnTheHead):
        run = Client(address or "auto").submit(spec)
        run.wait()
        return run.summary()
    prep, conn = where.prepare(req)
    return where.run(prep, conn, sink or PrintSink())


@dataclass
class PrintSink:
    """Hosts' lines to stdout, prefixed as the CLI prints them in a pipe; progress to stderr."""

    statuses: list = field(default_factory=list)

    def host_line(self, process: int, stream: str, text: str) -> None:
        print(f"[host {process}] {text}", flush=True)

    def progress(self, message: str) -> None:
        import sys

        print(message, file=sys.stderr, flush=True)

    def status(self, view: Any) -> None:
        self.statuses[:] = [view]


def _cluster(address: str) -> ClusterInfo:
    import os

    from tpulaunch.cluster.connect import resolve_address
    from tpulaunch.cluster.record import ClusterInfo

    if address.startswith(("http://", "https://")):
        return ClusterInfo(address=address, temp_dir=None, token_path=os.environ.get("RAY_AUTH_TOKEN_PATH"),
                           emulated=False, dashboard=address)
    info = resolve_address(address)
    if info is None:
        raise TpulaunchError("no cluster given", "pass an address, set RAY_ADDRESS, or `tpulaunch cluster up`")
    return info


def _spec(script: str | RunSpec, args: Sequence[str], env: Mapping[str, str] | None, topology: str | None,
          accelerator: str | None, num_slices: int | None, mesh: str | None, dcn: str | None,
          options: Mapping[str, Any]) -> RunSpec:
    """A `RunSpec` as given, or one made of the keywords (not both)."""
    if isinstance(script, RunSpec):
        if args or env or options or any(v is not None for v in (topology, accelerator, num_slices, mesh, dcn)):
            raise TpulaunchError("a RunSpec was given with keywords as well", "put everything in the RunSpec")
        return script
    if isinstance(args, str):
        raise TpulaunchError("args is one string", "pass a list, e.g. args=['--steps', '3']")
    return RunSpec(script, tuple(args), dict(env or {}), topology, accelerator, num_slices, mesh, dcn, dict(options))


def _request(spec: RunSpec, address: str | None) -> Any:
    """The `LaunchRequest` of a spec (an unknown option, a bad env name: one line, before anything is submitted)."""
    from tpulaunch import discover
    from tpulaunch.plan.launch import parse_env
    from tpulaunch.run.prepare import LaunchRequest

    known = {f.name for f in fields(LaunchRequest)} - {"script", "args", "slices", "env", "address", "mesh"}
    slice_opts = {f.name for f in fields(discover.SliceRequest)} - {"topology", "accelerator", "num_slices", "dcn"}
    options = spec.options or {}
    unknown = set(options) - known - slice_opts
    if unknown:
        raise TpulaunchError(f"unknown option(s) {', '.join(sorted(unknown))}",
                             f"choose from {', '.join(sorted(known | slice_opts))}")
    pairs = tuple(f"{k}={v}" for k, v in (spec.env or {}).items())
    parse_env(list(pairs))  # a bad name is one line here, before anything is submitted
    slices = discover.SliceRequest(topology=spec.topology, accelerator=spec.accelerator, num_slices=spec.num_slices,
                                   dcn=spec.dcn, **{k: v for k, v in options.items() if k in slice_opts})
    return LaunchRequest(script=spec.script, args=tuple(str(a) for a in spec.args), env=pairs, slices=slices,
                         mesh=spec.mesh, address=address, **{k: v for k, v in options.items() if k in known})
