"""tpulaunch as a Python library: submit runs to a cluster, watch them, stop them.

In the habits of Ray's `JobSubmissionClient` and SkyPilot's SDK::

    import tpulaunch
    client = tpulaunch.Client("auto")                   # or "HOST:PORT", "http://DASHBOARD"
    run = client.submit("train.py", topology="2x4", args=["--steps", "3"], env={"WANDB_API_KEY": key})
    run.id; run.status().state                         # "PENDING" | "RUNNING" | "SUCCEEDED" | "FAILED" | "STOPPED"
    for line in run.logs(follow=True): print(line)     # every host's prefixed lines
    code = run.wait(timeout=600)                       # the run's exit code, as `tpulaunch wait` gives it
    run.stop(); client.runs()                          # newest first
    summary = tpulaunch.launch("train.py", topology="2x4")   # foreground here; `.exit_code`

The cluster is found as the CLI finds it (`auto`: the one `tpulaunch cluster up` recorded here,
with its token). Runs go through the same code as `tpulaunch run --detach` (`run.runner`): the
supervisor is a Ray job on the head, the request (env values included) is stored behind the
cluster's token and never on a command line. Errors are tpulaunch's error classes, each with the
exit code the CLI would give (`e.exit_code`), never `SystemExit`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, fields
from typing import Any, Iterator, Mapping, Sequence

from tpulaunch.errors import ExitCode, TpulaunchError

__all__ = ["Client", "Run", "RunStatus", "WaitTimeout", "launch"]


class WaitTimeout(TpulaunchError):
    """`Run.wait(timeout=...)` ran out before the run ended (the CLI's `wait` exits 124)."""

    exit_code = ExitCode.TIMEOUT


@dataclass(frozen=True)
class RunStatus:
    """One run as the cluster knows it (what `tpulaunch status RUN --json` prints)."""

    run_id: str
    state: str  # PENDING, RUNNING, RESTARTING, SUCCEEDED, FAILED, STOPPED, LOST, UNKNOWN
    script: str = ""
    attempt: int | None = None
    exit_code: int | None = None
    started: float | None = None
    ended: float | None = None
    message: str | None = None
    hosts: tuple[dict, ...] = ()
    attempts: tuple[dict, ...] = ()
    note: str | None = None

    @property
    def terminal(self) -> bool:
        return self.state in ("SUCCEEDED", "FAILED", "STOPPED", "LOST")

    def to_dict(self) -> dict:
        """The `tpulaunch.run-status/v1` document (states lower-case, as the CLI has always printed them)."""
        now = time.time()
        return {"schema": "tpulaunch.run-status/v1", "run_id": self.run_id, "script": self.script,
                "state": self.state.lower(), "attempt": self.attempt, "exit_code": self.exit_code,
                "started": self.started, "ended": self.ended,
                "duration_s": (self.ended or now) - self.started if self.started else None,
                "message": self.message, "hosts": [dict(h) for h in self.hosts], "attempts": [dict(a) for a in self.attempts],
                "note": self.note}

    @staticmethod
    def of(rec: Any) -> "RunStatus":  # rec: detached.RunRecord
        j, v = rec.job, rec.view
        now = time.time()
        hosts = tuple({"process_index": h.process_index, "slice_index": h.slice_index, "worker_id": h.worker_id,
                       "state": str(h.phase), "exit_code": h.exit_code,
                       "since_last_s": None if not h.last_activity else round(now - h.last_activity, 1),
                       "last_line": h.last_line, "reason": h.reason, "step": h.step, "step_rate": h.step_rate}
                      for h in (v.hosts if v else ()))
        state = rec.state
        return RunStatus(rec.run_id, state.name, j.metadata.get("script", ""), v.attempt if v else None, rec.exit_code,
                         j.start_time, j.end_time, j.message if state.value in ("failed", "lost") else None, hosts,
                         tuple(v.attempts) if v else (), v.note if v else None)


class Run:
    """A handle on one run of a cluster (cheap: it holds the id; every call asks the cluster)."""

    def __init__(self, client: "Client", run_id: str) -> None:
        self._client = client
        self.id = run_id

    def __repr__(self) -> str:
        return f"Run({self.id!r})"

    def _record(self) -> Any:
        from tpulaunch.run import detached

        api = self._client._api()
        return detached.record(api, detached.find(api, self.id))

    def status(self) -> RunStatus:
        return RunStatus.of(self._record())

    def logs(self, follow: bool = False, *, host: int | None = None, attempt: int | None = None) -> Iterator[str]:
        """The run's lines: every host's, prefixed `[host i]` (as a foreground run prints them), or one
        host's whole log of one attempt (default: the latest). `follow`: until the run ends."""
        from tpulaunch.run import detached

        api = self._client._api()
        if host is None:
            chunks = detached.follow_driver_log(api, self.id) if follow else iter(
                [detached.run_output(api.driver_log(self.id))])
        else:
            chunks = detached.follow_host_log(api, detached.find(api, self.id), host, attempt, follow)
        pending = ""
        for chunk in chunks:
            pending += chunk
            *lines, pending = pending.split("\n")
            yield from lines
        if pending:
            yield pending

    def wait(self, timeout: float | None = None, poll_s: float = 1.0) -> int:
        """Block until the run ends; its exit code (the README's table). `WaitTimeout` after `timeout` s."""
        from tpulaunch.run import detached

        if timeout is not None and not timeout > 0:
            raise TpulaunchError(f"timeout {timeout!r} is not a positive number of seconds", "e.g. timeout=3600")
        rec = detached.wait(self._client._api(), self.id, timeout, poll_s)
        if not rec.job.terminal:
            raise WaitTimeout(f"run {self.id} is still {rec.state} after {timeout:g} s", "wait again, or stop it")
        return rec.exit_code if rec.exit_code is not None else 1

    def stop(self) -> RunStatus:
        """Stop the run as SIGTERM stops a foreground one (every host stopped, logs kept; exit 143)."""
        from tpulaunch.run import detached

        api = self._client._api()
        job = detached.find(api, self.id)
        if not job.terminal:
            api.stop(job.submission_id)
        return RunStatus.of(detached.wait(api, job.submission_id, detached.STOP_WAIT_S + 30))


class Client:
    """A cluster's runs. `address`: `auto` (recorded here by `cluster up`), `HOST:PORT`, or the
    dashboard's `http://HOST:PORT`; the token is the cluster's own, as the CLI finds it."""

    def __init__(self, address: str = "auto") -> None:
        self.address = address
        self._cluster = _cluster(address)
        self._job_api: Any = None

    def _api(self) -> Any:
        from tpulaunch.run import detached

        if self._job_api is None:
            self._job_api = detached.job_api(self._cluster)
        return self._job_api

    def submit(self, script: str, *, args: Sequence[str] = (), env: Mapping[str, str] | None = None,
               topology: str | None = None, accelerator: str | None = None, num_slices: int | None = None,
               mesh: str | None = None, dcn: str | None = None, **options: Any) -> Run:
        """Submit `script` (a path inside `workdir`, default `.`) to run on the cluster; returns at once.
        `options` are `tpulaunch run`'s other flags by their `LaunchRequest` names (`framework`,
        `max_restarts`, `timeout`, `placement`, `workdir`, ...)."""
        from tpulaunch.run import runner

        req = _request(script, args, env, topology, accelerator, num_slices, mesh, dcn, self._cluster.address, options)
        where = runner.OnTheHead(self._cluster, runner.Target(self._cluster))
        checked, _ = where.check(req)
        return Run(self, where.submit(checked, self._api()))

    def run(self, run_id: str) -> Run:
        """A run of this cluster by id, or `last` (the newest)."""
        from tpulaunch.run import detached

        return Run(self, detached.find(self._api(), run_id).submission_id)

    def runs(self) -> list[Run]:
        """Every run on the cluster, newest first."""
        from tpulaunch.run import detached

        return [Run(self, j.submission_id) for j in reversed(detached.runs(self._api()))]


def launch(script: str, *, args: Sequence[str] = (), env: Mapping[str, str] | None = None,
           topology: str | None = None, accelerator: str | None = None, num_slices: int | None = None,
           mesh: str | None = None, dcn: str | None = None, address: str | None = None, sink: Any = None,
           **options: Any) -> Any:
    """Run `script` in the foreground, as `tpulaunch run` does (emulated here when no cluster is
    given); returns the run's `RunSummary` (`.exit_code`, `.hosts`, `.attempts`). On a cluster whose
    head is elsewhere the run goes there and this waits for it: a `RunStatus` (`.exit_code`).
    `sink` receives the hosts' lines (default: printed `[host i] ...`)."""
    from tpulaunch.run import runner

    req = _request(script, args, env, topology, accelerator, num_slices, mesh, dcn, address, options)
    where = runner.choose(req)
    if isinstance(where, runner.OnTheHead):
        run = Client(address or "auto").submit(script, args=args, env=env, topology=topology, accelerator=accelerator,
                                               num_slices=num_slices, mesh=mesh, dcn=dcn, **options)
        run.wait()
        return run.status()
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


def _cluster(address: str) -> Any:
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


def _request(script: str, args: Sequence[str], env: Mapping[str, str] | None, topology: str | None,
             accelerator: str | None, num_slices: int | None, mesh: str | None, dcn: str | None, address: str | None,
             options: Mapping[str, Any]) -> Any:
    from tpulaunch import discover
    from tpulaunch.run.prepare import LaunchRequest

    known = {f.name for f in fields(LaunchRequest)} - {"script", "args", "slices", "env", "address", "mesh"}
    slice_opts = {f.name for f in fields(discover.SliceRequest)} - {"topology", "accelerator", "num_slices", "dcn"}
    unknown = set(options) - known - slice_opts
    if unknown:
        raise TpulaunchError(f"unknown option(s) {', '.join(sorted(unknown))}",
                             f"choose from {', '.join(sorted(known | slice_opts))}")
    if isinstance(args, str):
        raise TpulaunchError("args is one string", "pass a list, e.g. args=['--steps', '3']")
    pairs = tuple(f"{k}={v}" for k, v in (env or {}).items())
    from tpulaunch.plan.launch import parse_env

    parse_env(list(pairs))  # a bad name is one line here, before anything is submitted
    slices = discover.SliceRequest(topology=topology, accelerator=accelerator, num_slices=num_slices, dcn=dcn,
                                   **{k: v for k, v in options.items() if k in slice_opts})
    return LaunchRequest(script=script, args=tuple(str(a) for a in args), env=pairs, slices=slices, mesh=mesh,
                         address=address, **{k: v for k, v in options.items() if k in known})
