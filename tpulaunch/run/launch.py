"""One launch from start to end: get a Ray cluster (start an emulated one if none was given),
execute the plan on it, and clean up whatever this launch started."""

from __future__ import annotations

import signal

from tpulaunch.cluster import emulated
from tpulaunch.cluster.connect import connect, disconnect
from tpulaunch.cluster.record import ClusterInfo
from tpulaunch.errors import ClusterError, ExitCode, LaunchError
from tpulaunch.run.execute import RunSummary, Sink, execute
from tpulaunch.run.prepare import Prepared


class _Terminated(BaseException):
    pass


def _raise_terminated(_signum: int, _frame: object) -> None:
    raise _Terminated()


def launch(prep: Prepared, sink: Sink, *, dashboard: bool = False) -> RunSummary:
    """Get a cluster (start an emulated one if none was given), execute, and clean up after."""
    plan = prep.plan
    owned: ClusterInfo | None = None
    old_term = signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        cluster = prep.cluster
        if cluster is None:
            if not plan.emulated:
                raise LaunchError(
                    "this slice is real but no Ray cluster was given",
                    "bring Ray up on it with `tpulaunch cluster up --tpu NAME` and pass --address auto",
                )
            sink.progress(
                f"starting an emulated Ray cluster: {len(plan.hosts)} host node(s) for "
                f"{plan.mesh.num_slices} x {plan.topology.accelerator_type} ({plan.topology.topology})"
            )
            owned = cluster = emulated.start_emulated(list(plan.slices), plan.topology, dashboard=dashboard,
                                                      progress=sink.progress)
        connect(cluster, prep.runtime_env)
        signal.signal(signal.SIGTERM, old_term)
        return execute(plan, sink, schedule_timeout_s=prep.request.schedule_timeout, kill_stale=prep.request.kill_stale)
    except _Terminated:
        err = ClusterError("terminated while starting", "nothing was left running")
        err.exit_code = ExitCode.TERMINATED
        raise err from None
    finally:
        signal.signal(signal.SIGTERM, old_term)
        disconnect()
        if owned is not None:
            sink.progress("stopping the emulated Ray cluster")
            emulated.stop_cluster(owned)
