"""Where a run runs: here (this process supervises it), or on the cluster's head (a Ray job).

One choice, made once (`choose`), by the CLI and the Python client alike:

* `Here`: the foreground `tpulaunch run`: plan with the cluster's facts, then supervise every
  attempt from this process (a cluster of its own is started when none is given).
* `OnTheHead`: `--detach`, or any run on a cluster whose head is elsewhere: the same supervision
  runs as a Ray job on the head (`tpulaunch supervise`), and this side only submits and reads.
  Its request is stored behind the cluster's token, never on a command line (`detached`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from tpulaunch.cluster.jobs import JobApi
from tpulaunch.cluster.record import ClusterInfo
from tpulaunch.errors import LaunchError
from tpulaunch.run import detached
from tpulaunch.run.execute import Sink
from tpulaunch.run.launch import Connection, launch
from tpulaunch.run.prepare import (
    Checked,
    LaunchRequest,
    Prepared,
    Target,
    check,
    find_cluster,
    is_local,
    prepare,
    shipped_workdir,
)
from tpulaunch.run.summary import RunSummary


@dataclass
class Here:
    """The run is supervised by this process."""

    target: Target

    def prepare(self, req: LaunchRequest) -> tuple[Prepared, Connection]:
        """The plan, and the one connection the run will use (closed here if planning fails)."""
        c = check(req)
        real = self.target.cluster is not None and not self.target.cluster.emulated
        ship = shipped_workdir(c)  # checked even when not shipped: a rehearsal refuses what the slice would
        conn = Connection(self.target, ship if real else None)
        try:
            return prepare(c, self.target, conn.cluster_slices(req), conn.runtime_env), conn
        except BaseException:
            conn.close()
            raise

    def run(self, prep: Prepared, conn: Connection, sink: Sink, *, debug: bool = False) -> RunSummary:
        return launch(prep, sink, conn, quiet_ray=True, debug=debug)


@dataclass
class OnTheHead:
    """The run is a Ray job on the cluster's head; this side submits it and reads it back."""

    cluster: ClusterInfo
    target: Target

    def api(self) -> JobApi:
        return detached.job_api(self.cluster)

    def check(self, req: LaunchRequest) -> tuple[Checked, Prepared | None]:
        """Everything this machine can check before submitting (the CLI and the client alike): the
        request's values, script and working directory, and what its recovery needs of the cluster;
        the whole plan too when the head is here (then it is returned)."""
        c = check(req)
        if not is_local(self.cluster):
            c.supervision.check(self.cluster, local=False)
            return c, None
        conn = Connection(self.target, None)  # planning ships nothing
        try:
            return c, prepare(c, self.target, conn.cluster_slices(req), shipped_workdir(c))
        finally:
            conn.close()

    def submit(self, checked: Checked, api: JobApi | None = None) -> str:
        """Submit a checked request; the run's id."""
        return detached.submit(checked.request, self.cluster, api or self.api(), runtime_env=shipped_workdir(checked))


def choose(req: LaunchRequest, *, detach: bool = False, dry_run: bool = False) -> Here | OnTheHead:
    """Here, or on the head: on the head when asked (`detach`) or when the head is elsewhere."""
    target = find_cluster(req)
    remote = target.cluster is not None and not is_local(target.cluster)
    if detach or (remote and not dry_run):
        if target.cluster is None:
            raise LaunchError("--detach runs the run on a cluster's head, and none was given",
                              "bring one up (`tpulaunch cluster up ...`) and pass --address auto (or HOST:PORT)")
        return OnTheHead(target.cluster, target)
    return Here(target)


def supervise(req: LaunchRequest, sink_for: Callable[[Prepared], detached.StatusFile]) -> RunSummary:
    """A detached run's supervisor, in its Ray job on the head: `Here` with the run's files under the
    head's Ray log directory (served by Ray's log API) and `status.json` kept up to date."""
    from tpulaunch.cluster.connect import logs_dir

    target = find_cluster(req)
    if target.cluster is None:
        raise LaunchError("a supervisor runs on a cluster, and its request names none", "submit the run again")
    # The job's runtime env already carries the working directory to every actor the supervisor
    # starts (Ray would refuse a second one): the connection ships nothing itself.
    conn = Connection(target, None)
    conn.connect(target.cluster)
    req = replace(req, log_dir=str(Path(logs_dir()) / detached.RUNS_SUBDIR))
    try:
        prep = prepare(req, target, conn.cluster_slices(req), None)
    except BaseException:
        conn.close()
        raise
    sink = sink_for(prep)
    summary = launch(prep, sink, conn, quiet_ray=True)
    sink.finished(summary)
    return summary
