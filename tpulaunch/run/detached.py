"""Runs that live on the cluster's head: submitted as Ray jobs, read back from any machine.

`tpulaunch run --detach` submits the launcher itself as a Ray job on the head node: the job runs
`tpulaunch supervise <request>`, which is the same `tpulaunch run` supervision (plan, attempts,
restarts, preemptions, timeouts, logs, summary). Its files go under the head's Ray log directory,
`tpulaunch/runs/<run id>/` (host logs, `status.json` every few seconds, `summary.json` at the end),
so Ray's log API serves them to any client with the cluster's address and token; the job's own
log is the supervisor's output (every host's prefixed lines).

The run id is the job's submission id: Ray refuses a second submission of the same id, so a
client killed while submitting leaves either one run or none. What a run's state is comes from
the job API and the run's `status.json` together (`run_state`, pure): nothing is invented when
either is missing.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shlex
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from tpulaunch import discover
from tpulaunch.cluster.jobs import JobApi, JobInfo
from tpulaunch.cluster.record import ClusterInfo, check_token_file
from tpulaunch.errors import ClusterError, LaunchError, TpulaunchError
from tpulaunch.plan.launch import new_run_id
from tpulaunch.run.paths import RunPaths
from tpulaunch.run.prepare import LaunchRequest
from tpulaunch.run.status import RunState, RunView

if TYPE_CHECKING:
    from tpulaunch.run.execute import Sink
    from tpulaunch.run.summary import RunSummary

RUNS_SUBDIR = "tpulaunch/runs"  # under the head's Ray log directory
META_KEY = "tpulaunch"  # every job tpulaunch submits carries metadata {"tpulaunch": "run", ...}
STOP_WAIT_S = 90  # what Ray gives the supervisor after SIGTERM (it stops every host first)


# -- the request, across the job boundary ----------------------------------------------------------


# The request (its `--env` values included) never travels on a command line or in the job table:
# the client stores it in the cluster's GCS behind the token (the job API's package upload, where
# `ray job submit` puts a working directory) and the job's entrypoint names only its key. The
# supervisor reads it and deletes it.
REQUEST_SCHEMA = "tpulaunch.request/v1"
REQUEST_PREFIX = "gcs://_tpulaunch_request_"
MAX_REQUEST_BYTES = 1 << 20


def request_uri(run_id: str) -> str:
    return f"{REQUEST_PREFIX}{run_id}.zip"  # Ray's package store takes only .zip names


def request_document(req: LaunchRequest) -> bytes:
    """The versioned document a detached run's supervisor is started from."""
    return json.dumps({"schema": REQUEST_SCHEMA, "request": dataclasses.asdict(req)}).encode()


def read_request_document(data: bytes) -> LaunchRequest:
    """The request from `request_document`'s bytes; one line (exit 2) for anything else."""
    from tpulaunch.errors import TpulaunchError

    if len(data) > MAX_REQUEST_BYTES:
        raise TpulaunchError(f"the run's request is {len(data)} bytes, more than {MAX_REQUEST_BYTES}",
                             "submit it again")
    try:
        doc = json.loads(data.decode())
    except (UnicodeDecodeError, ValueError):
        raise TpulaunchError("the run's request is not a JSON document", "submit the run again") from None
    schema = doc.get("schema") if isinstance(doc, dict) else None
    if schema != REQUEST_SCHEMA:
        raise TpulaunchError(f"the run's request is {schema!r}, this tpulaunch reads {REQUEST_SCHEMA!r}",
                             "submit from a client with the same tpulaunch version as the head")
    try:
        d = dict(doc["request"])
        d["slices"] = discover.SliceRequest(**d["slices"])
        for key in ("args", "command", "env"):
            d[key] = tuple(d[key])
        return LaunchRequest(**d)
    except (KeyError, TypeError, ValueError) as e:
        raise TpulaunchError(f"the run's request does not fit this tpulaunch: {e}",
                             "submit from a client with the same tpulaunch version as the head") from None


def take_request(uri: str) -> LaunchRequest:
    """On the head: the stored request (the job's Ray gives the address and token), then delete it."""
    from tpulaunch.errors import TpulaunchError

    if not uri.startswith(REQUEST_PREFIX) or not re.fullmatch(r"[A-Za-z0-9_.-]+", uri.removeprefix("gcs://")):
        raise TpulaunchError(f"--request {uri[:80]!r} is not a run's request", "`tpulaunch run --detach` starts these")
    address = os.environ.get("RAY_ADDRESS", "")
    if not address:
        raise TpulaunchError("a supervisor runs as a Ray job (RAY_ADDRESS names its cluster)",
                             "`tpulaunch run --detach` starts these")
    from ray._raylet import GcsClient  # type: ignore[attr-defined]  # in the .so; _raylet.pyi omits it

    gcs = GcsClient(address=address.removeprefix("ray://"))
    key = uri.encode()
    data = gcs.internal_kv_get(key, namespace=None, timeout=15)
    if data is None:
        raise TpulaunchError(f"the cluster holds no request {uri}", "it is read once; submit the run again")
    gcs.internal_kv_del(key, False, namespace=None, timeout=15)
    return read_request_document(data)


# -- which cluster, which API -----------------------------------------------------------------------


def job_api(cluster: ClusterInfo) -> JobApi:
    """The job API of `cluster`: its recorded dashboard, `RAY_API_SERVER_ADDRESS`, or an http:// address."""
    token = None
    if cluster.token_path:
        token = check_token_file(cluster.token_path, "the cluster's token file")
    elif os.environ.get("RAY_AUTH_TOKEN"):
        token = os.environ["RAY_AUTH_TOKEN"].strip()
    from tpulaunch import providers

    url = providers.of(cluster).job_url() or cluster.dashboard or os.environ.get("RAY_API_SERVER_ADDRESS") or (
        cluster.address if cluster.address.startswith(("http://", "https://")) else None)
    if not url:
        url = _dashboard_from_gcs(cluster)
    if not url.startswith(("http://", "https://")):
        url = "http://" + url
    return JobApi(url, token)


def _dashboard_from_gcs(cluster: ClusterInfo) -> str:
    """Ask the cluster's GCS where its dashboard is (the key Ray's own job client reads)."""
    from tpulaunch.cluster.connect import RaysStderr, is_auth_error, probe, token_refused

    probe(cluster.address, 5.0)
    for k, v in cluster.ray_env().items():
        os.environ.setdefault(k, v)
    try:
        with RaysStderr() as said:  # Ray's own complaints stay off the terminal
            from ray._raylet import GcsClient  # type: ignore[attr-defined]  # in the .so; _raylet.pyi omits it

            raw = GcsClient(address=cluster.address.removeprefix("ray://")).internal_kv_get(
                b"webui:url", namespace=b"dashboard", timeout=10)
    except Exception as e:  # Ray raises many types
        if said.rejected() or is_auth_error(e):
            raise token_refused(cluster) from None
        raise ClusterError(f"could not ask the cluster at {cluster.address} where its dashboard is: {type(e).__name__}",
                           "pass the dashboard as --address http://HOST:PORT, or set RAY_API_SERVER_ADDRESS") from None
    if not raw:
        raise ClusterError(f"the cluster at {cluster.address} runs no dashboard (no job API)",
                           "bring it up with `tpulaunch cluster up` (the dashboard is on by default)")
    return raw.decode()


# -- submitting -------------------------------------------------------------------------------------


def supervisor_entrypoint(run_id: str, python: str, workdir: str | None) -> str:
    """The shell line the job runs: `tpulaunch supervise` and where its request is (in place when `workdir`)."""
    line = f"{shlex.quote(python)} -m tpulaunch supervise --request {shlex.quote(request_uri(run_id))}"
    return f"cd {shlex.quote(workdir)} && exec {line}" if workdir else f"exec {line}"


def submit(req: LaunchRequest, cluster: ClusterInfo, api: JobApi, *, runtime_env: dict | None) -> str:
    """Submit the run; returns its id (the job's submission id). The request's address becomes the
    cluster's own (the supervisor connects from the head)."""
    from tpulaunch.run.prepare import head_python, is_local

    run_id = req.run_id or new_run_id()
    sup_req = dataclasses.replace(req, run_id=run_id, address=cluster.address, log_dir=RUNS_SUBDIR)
    from tpulaunch import providers

    env_vars = {"RAY_JOB_STOP_WAIT_TIME_S": str(STOP_WAIT_S), "PYTHONUNBUFFERED": "1", "NO_COLOR": "1",
                **providers.of(cluster).supervisor_env()}
    if is_local(cluster):
        # The head is this machine: the supervisor reads the same cluster record.
        from tpulaunch.cluster.record import state_dir

        env_vars["TPULAUNCH_HOME"] = str(state_dir())
    if cluster.emulated:
        # ... and so do the hosts, which share this filesystem: the script runs in place.
        workdir, job_env = str(Path(req.workdir).resolve()), {"env_vars": env_vars}
        sup_req = dataclasses.replace(sup_req, workdir=workdir)
    else:
        # Hosts on other machines: the job carries the working directory to the supervisor and to
        # every actor it starts (its cwd is the unpacked copy).
        workdir, job_env = None, {**(runtime_env or {}), "env_vars": env_vars}
        sup_req = dataclasses.replace(sup_req, workdir=".")
    entry = supervisor_entrypoint(run_id, head_python(cluster), workdir)
    meta = {META_KEY: "run", "run_id": run_id, "script": req.script or " ".join(req.command),
            "submitted_from": os.uname().nodename}
    if api.info(run_id) is not None:  # its request would overwrite a running run's
        raise ClusterError(f"a run with id {run_id} was already submitted to this cluster",
                           "see it with `tpulaunch status " + run_id + "`")
    api.put_package(request_uri(run_id), request_document(sup_req))
    api.submit(entrypoint=entry, submission_id=run_id, runtime_env=job_env, metadata=meta)
    return run_id


def run_tool(api: JobApi, args: list[str], *, python: str, timeout_s: float = 120.0) -> tuple[int, str]:
    """`tpulaunch ARGS` on the head, as a short Ray job (a run's files are there, and its Ray is
    reachable from there): (exit code, what it printed). Not listed by `tpulaunch runs`."""
    sid = f"tpulaunch-{args[0]}-{new_run_id()}"
    line = " ".join(shlex.quote(a) for a in [python, "-m", "tpulaunch", *args])
    api.submit(entrypoint=f"exec {line}", submission_id=sid, metadata={META_KEY: "tool", "tool": args[0]},
               runtime_env={"env_vars": {"NO_COLOR": "1", "PYTHONUNBUFFERED": "1"}})
    deadline = time.monotonic() + timeout_s
    while True:
        job = api.info(sid)
        if job is not None and job.terminal:
            return (job.driver_exit_code if job.driver_exit_code is not None else 1), run_output(api.driver_log(sid))
        if time.monotonic() >= deadline:
            api.stop(sid)
            raise ClusterError(f"`tpulaunch {args[0]}` on the head did not answer within {timeout_s:.0f} s",
                               "the head may be overloaded; try again")
        time.sleep(0.3)


# -- reading ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RunRecord:
    """One run as the cluster knows it: its job, and its status file if the supervisor wrote one."""

    run_id: str
    job: JobInfo
    view: RunView | None

    @property
    def state(self) -> RunState:
        return run_state(self.job, self.view)

    @property
    def exit_code(self) -> int | None:
        return run_exit_code(self.job, self.view)


def run_state(job: JobInfo | None, view: RunView | None) -> RunState:
    """What a run is, from what the job API and its status file say (pure; invents nothing)."""
    if job is None:
        return RunState.UNKNOWN
    if job.status == "PENDING":
        return RunState.PENDING
    if job.status == "RUNNING":
        if view is None:
            return RunState.PENDING  # the supervisor has not written its first status yet
        return view.state if not view.state.terminal else RunState.RUNNING
    if job.status == "STOPPED":
        return RunState.STOPPED
    if job.status == "SUCCEEDED":
        return RunState.SUCCEEDED
    if job.status == "FAILED":
        if job.supervisor_lost:
            return RunState.LOST  # the supervisor died with its node: the hosts' fate is not known here
        if view is not None and view.state is RunState.STOPPED:
            return RunState.STOPPED
        return RunState.FAILED
    return RunState.UNKNOWN


def run_exit_code(job: JobInfo | None, view: RunView | None) -> int | None:
    """The run's own exit code (the README's table) once it ended; None while it runs or if unknown."""
    if job is None or not job.terminal:
        return None
    if view is not None and view.exit_code is not None:
        return view.exit_code
    return job.driver_exit_code


def run_paths(run_id: str) -> RunPaths:
    """A detached run's files, relative to the head's Ray log directory (what Ray's log API serves)."""
    return RunPaths.of(f"{RUNS_SUBDIR}/{run_id}")



def read_view(api: JobApi, job: JobInfo) -> RunView | None:
    if not job.driver_node_id:
        return None
    text = api.read_file(job.driver_node_id, str(run_paths(job.submission_id).status))
    if not text:
        return None
    try:
        doc = json.loads(text)
        return RunView.from_dict(doc) if isinstance(doc, dict) else None
    except (ValueError, KeyError, TypeError, AttributeError, RecursionError):
        return None  # being written (never half: it is replaced whole), or from another version


def runs(api: JobApi) -> list[JobInfo]:
    """Every run tpulaunch submitted to this cluster, oldest first."""
    mine = [j for j in api.list() if j.metadata.get(META_KEY) == "run"]
    return sorted(mine, key=lambda j: (j.start_time or 0.0, j.submission_id))


def check_run_id(run: str) -> str:
    """A RUN argument: a run id (what `run --detach` printed) or `last`; one line, exit 2, otherwise."""
    if not run.strip() or len(run) > 200 or not re.fullmatch(r"[A-Za-z0-9_.:-]+", run):
        shown = repr(run[:40]) + ("..." if len(run) > 40 else "")
        raise LaunchError(f"RUN {shown} is not a run id", "give the id `run --detach` printed, or last")
    return run


def find(api: JobApi, run: str) -> JobInfo:
    """`RUN`: a run id, or `last` (the newest run on the cluster)."""
    check_run_id(run)
    if run == "last":
        mine = runs(api)
        if not mine:
            raise LaunchError("no run on this cluster yet", "start one with `tpulaunch run SCRIPT --detach`")
        return mine[-1]
    job = api.info(run)
    if job is None or job.metadata.get(META_KEY) != "run":
        known = ", ".join(j.submission_id for j in runs(api)[-5:]) or "none"
        raise LaunchError(f"no run {run} on this cluster", f"recent runs: {known} (`tpulaunch runs` lists them)")
    return job


def record(api: JobApi, job: JobInfo) -> RunRecord:
    return RunRecord(job.submission_id, job, read_view(api, job))


def wait(api: JobApi, run_id: str, timeout_s: float | None, poll_s: float = 1.0) -> RunRecord:
    """Until the run ends (or `timeout_s`); its last record."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while True:
        job = api.info(run_id)
        if job is None:
            raise ClusterError(f"the cluster no longer knows run {run_id} (its head restarted?)",
                               "its logs may still be on the head under " + str(run_paths(run_id).root))
        if job.terminal:
            return record(api, job)
        if deadline is not None and time.monotonic() >= deadline:
            return record(api, job)
        time.sleep(poll_s)


_RAYS_OWN = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}\t(DEBUG|INFO|WARNING|ERROR) \S+\.py:\d+ -- "
                       r"|Running entrypoint for job \S+: )")


def run_output(driver_log: str) -> str:
    """The supervisor's output from a job's log, without the lines Ray's job manager adds to it
    ("Runtime env is setting up.", "Running entrypoint for job ...")."""
    return "".join(line for line in driver_log.splitlines(keepends=True) if not _RAYS_OWN.match(line))


def no_log(run_id: str) -> TpulaunchError:
    """The one line for a run whose log the head does not have (its files were removed, or the run
    never started): exit 2, never an empty success."""
    return TpulaunchError(f"run {run_id} has no log on the cluster's head: its files were removed (or it never"
                          " started)", f"`tpulaunch status {run_id}` still shows how it ended")


def driver_output(api: JobApi, job: JobInfo) -> str:
    """What the run's supervisor printed (`run_output`); `no_log` for a run that ended without a log
    (a supervisor always prints, so an empty log of an ended run is one that is gone)."""
    text = api.driver_log(job.submission_id)
    if not text and job.terminal:
        raise no_log(job.submission_id)
    return run_output(text)


def follow_driver_log(api: JobApi, run_id: str, poll_s: float = 0.5,
                      require_log: bool = False) -> Iterator[str]:
    """The supervisor's output as it grows (whole lines), until the run ends (then the rest);
    with `require_log`, `no_log` if it ended with none (`tpulaunch logs`; a `run --follow` ends
    with the run's own exit code instead)."""
    seen = 0
    while True:
        job = api.info(run_id)
        text = api.driver_log(run_id)
        done = job is None or job.terminal
        if done:
            text = api.driver_log(run_id)
        end = len(text) if done else text.rfind("\n") + 1
        if end > seen:
            yield run_output(text[seen:end])
            seen = end
        if done:
            if require_log and not seen:
                raise no_log(run_id)
            return
        time.sleep(poll_s)


def follow_host_log(api: JobApi, job: JobInfo, host: int, attempt: int | None, follow: bool) -> Iterator[str]:
    """One host's whole log of one attempt (default: the run's latest), as it grows when `follow`."""
    from tpulaunch.errors import TpulaunchError

    view = read_view(api, job)
    k = attempt if attempt is not None else (view.attempt if view else 0)
    if not job.driver_node_id:
        raise TpulaunchError(f"run {job.submission_id} has not started on the head yet", "try again in a moment")
    name = str(run_paths(job.submission_id).host_log(k, host))
    missing = TpulaunchError(f"run {job.submission_id} has no log of host {host} in attempt {k}",
                             "see `tpulaunch status " + job.submission_id + "` for its hosts and attempts")
    seen, found = 0, False
    while True:
        text = api.read_file(job.driver_node_id, name)
        if text is None and not follow:
            raise missing
        found = found or text is not None
        text = text or ""
        if len(text) > seen:
            yield text[seen:]
            seen = len(text)
        info = api.info(job.submission_id)
        if not follow or info is None or info.terminal:
            if follow:
                rest = api.read_file(job.driver_node_id, name)
                found = found or rest is not None
                if rest is not None and len(rest) > seen:
                    yield rest[seen:]
                if not found:  # the run ended and its host's log never was there (or was removed)
                    raise missing
            return
        time.sleep(1.0)


# -- the supervisor's side ---------------------------------------------------------------------------


class StatusFile:
    """A sink that passes everything on and keeps `status.json` of the run up to date."""

    def __init__(self, inner: Sink, path: Path, script: str) -> None:
        self.inner, self.path, self.script = inner, path, script
        self.started = time.time()
        self.history: tuple[dict, ...] = ()

    def host_line(self, process: int, stream: str, text: str) -> None:
        self.inner.host_line(process, stream, text)

    def progress(self, message: str) -> None:
        self.inner.progress(message)

    def status(self, view: RunView) -> None:
        from tpulaunch.run import status as st

        self.history = view.attempts or self.history
        self.path.parent.mkdir(parents=True, exist_ok=True)
        st.write(self.path, dataclasses.replace(view, script=self.script, started=self.started, attempts=self.history,
                                                updated=time.time()))
        self.inner.status(view)

    def finished(self, summary: RunSummary) -> None:
        """The end: the state and exit code the run ended with."""
        from tpulaunch.run.summary import Outcome, attempts_brief

        ended = {Outcome.OK: RunState.SUCCEEDED, Outcome.INTERRUPTED: RunState.STOPPED}
        state = ended.get(summary.outcome, RunState.FAILED)
        from tpulaunch.run.status import HostPhase, HostView

        last = summary.attempts[-1].index if summary.attempts else 0
        hosts = tuple(HostView(h.process_index, h.slice_index, h.worker_id,
                               HostPhase.LOST if h.lost
                               else HostPhase.STOPPED if h.stopped_by_tpulaunch else HostPhase.EXITED,
                               h.exit_code, None, "", h.reason, h.step, h.step_rate) for h in summary.hosts)
        view = RunView(summary.run_id, state, last, hosts, attempts_brief(summary.attempts),
                       exit_code=summary.exit_code, note=summary.note)
        self.history = view.attempts
        self.status(view)
