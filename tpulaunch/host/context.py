"""What a launched script sees: `tpulaunch.get_mesh()`, `tpulaunch.context()`, `tpulaunch.heartbeat()`.

The host bootstrap (`tpulaunch/host/bootstrap.py`) installs these before the user's script runs.
Outside a launch they raise a clear error instead of returning something half-right.
"""

from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING, Any

from tpulaunch.errors import LaunchError
from tpulaunch.host.heartbeat import record as beat_record
from tpulaunch.plan.mesh import MeshPlan

if TYPE_CHECKING:
    from tpulaunch.plan.contract import HostState


class RunContext:
    """Facts about this process's place in the launch: a read-only view of its `HostState`."""

    __slots__ = ("state", "local_index")
    state: HostState
    local_index: int | None  # torch_tpu: this process's device on its host (one process per device); None: one per host

    def __init__(self, state: HostState, local_index: int | None = None) -> None:
        object.__setattr__(self, "state", state)
        object.__setattr__(self, "local_index", local_index)

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("RunContext is read-only")

    def __reduce__(self) -> tuple:
        return RunContext, (self.state, self.local_index)

    def __repr__(self) -> str:
        return (f"RunContext(run_id={self.run_id!r}, process_index={self.process_index}, num_processes="
                f"{self.num_processes}, slice={self.slice_name!r}, worker_id={self.worker_id},"
                f" restart_count={self.restart_count}, emulated={self.emulated})")

    @property
    def run_id(self) -> str:
        return self.state.job.run_id

    @property
    def process_index(self) -> int:
        """= slice_index * hosts_per_slice + worker_id."""
        return self.state.slot.process_index

    @property
    def num_processes(self) -> int:
        return self.state.num_processes

    @property
    def worker_id(self) -> int:
        """The TPU worker id within the slice."""
        return self.state.slot.worker_id

    @property
    def slice_index(self) -> int:
        return self.state.slot.slice_index

    @property
    def num_slices(self) -> int:
        return self.state.num_slices

    @property
    def full_num_slices(self) -> int:
        """The slices the run asked for (`--num-slices`); more than `num_slices` while an elastic run
        (`--min-slices`) trains on the ones that survived a preemption."""
        return self.state.job.full_num_slices or self.state.num_slices

    @property
    def attempt_reason(self) -> str:
        """Why this attempt runs, one of "first", "restart" (a failure), "preemption" (the slices came
        back), "shrink" (on fewer slices after one was lost) or "grow" (back to more slices)."""
        return self.state.reason

    @property
    def slice_name(self) -> str:
        return self.state.slot.slice_name

    @property
    def accelerator_type(self) -> str:
        return self.state.job.topology.accelerator_type

    @property
    def topology(self) -> str:
        return self.state.job.topology.topology

    @property
    def coordinator_address(self) -> str:
        """The address of process 0, its host and port joined by a colon (torch.distributed's
        MASTER_ADDR and MASTER_PORT)."""
        return self.state.endpoints.coordinator_address

    @property
    def framework(self) -> str:
        return self.state.job.framework

    @property
    def emulated(self) -> bool:
        return self.state.job.emulated

    @property
    def log_dir(self) -> str:
        return self.state.job.log_dir

    @property
    def mesh_plan(self) -> MeshPlan:
        return self.state.job.mesh

    @property
    def restart_count(self) -> int:
        """0 on the first attempt; resume from your checkpoint when > 0."""
        return self.state.attempt

    @property
    def is_coordinator(self) -> bool:
        """True on process 0, the one that should log, save, and report."""
        return self.process_index == 0

    @property
    def rank(self) -> int:
        """This process's rank in the job's default process group, `process_index` (one process per
        host), or under torch_tpu (one per device) process_index x devices per host + local_rank."""
        if self.local_index is None:
            return self.process_index
        return self.process_index * self.state.job.topology.devices_per_host + self.local_index

    @property
    def local_rank(self) -> int:
        """The process's index on its host (its device under torch_tpu), else 0."""
        return self.local_index or 0

    @property
    def local_world_size(self) -> int:
        """How many processes run on this host (its devices under torch_tpu), else 1."""
        return 1 if self.local_index is None else self.state.job.topology.devices_per_host

    @property
    def world_size(self) -> int:
        """How many processes the job has, `num_processes` (one per TPU host) or under torch_tpu one per device."""
        return self.num_processes * self.local_world_size

    @property
    def device(self) -> str:
        """The torch device type this process computes on, "tpu" (torch_tpu), "xla" (torch_xla),
        "cpu" on an emulated torch_tpu host, "" for JAX and none."""
        from tpulaunch.plan.frameworks import facts

        fw = facts(self.state.job.framework)
        return fw.emulated_device if self.emulated else fw.device


_STATE: dict[str, Any] = {"ctx": None, "mesh": None}
HEARTBEAT_ENV = "TPULAUNCH_HEARTBEAT_FILE"  # the agent watches this file's mtime
# What else the agent tells a host process (here, not in the agent's module: a spare starts after
# every run, and importing the agent was half of its start)
PY_STDIO_ENV = "TPULAUNCH_PY_STDIO_FDS"  # "OUT,ERR": the fds the bootstrap gives sys.stdout / sys.stderr
TIMINGS_ENV = "TPULAUNCH_TIMINGS_FILE"  # the bootstrap's phases (import, boot, mesh) as JSON

_OUTSIDE = (
    "not running under tpulaunch",
    "launch the script with `tpulaunch run SCRIPT --topology ...` (or use"
    " tpulaunch.plan.mesh.plan_mesh() yourself)",
)


def _install(ctx: RunContext, mesh: Any) -> None:
    _STATE["ctx"] = ctx
    _STATE["mesh"] = mesh


def context() -> RunContext:
    """This process's RunContext. Raises LaunchError outside a tpulaunch launch."""
    if _STATE["ctx"] is None:
        raise LaunchError(*_OUTSIDE)
    return _STATE["ctx"]


def get_mesh() -> Any:
    """The framework mesh built from the launch's MeshPlan (torch_xla `Mesh` or `jax.sharding.Mesh`)."""
    if _STATE["mesh"] is None:
        raise LaunchError(*_OUTSIDE)
    return _STATE["mesh"]


def get_mesh_plan() -> MeshPlan:
    """The pure MeshPlan the driver planned (device placement, sharding strings)."""
    return context().mesh_plan


_beat_fd: tuple[str, int] | None = None  # (path, fd): the heartbeat file, opened once
_beat_t = 0.0  # time.monotonic() of the last heartbeat
_saved: tuple[int, float, float] | None = None  # last heartbeat(checkpoint=True): (step, save seconds, when)
_first: tuple[int, float] | None = None  # (step, when) of this process's first heartbeat(step=N)


def heartbeat(step: int | None = None, checkpoint: bool = False) -> None:
    """Say "this host is making progress" without printing a line (`--stall-timeout` counts it);
    with `step`, also where it is: the launcher keeps each host's step rate and names a host that
    falls behind the others (`--straggler-ratio`), and `tpulaunch goodput` tells steps that counted
    from steps redone after a failure.

    `checkpoint=True`: step `step` is saved (call it when the save is done). The time since the
    previous heartbeat is counted as the save's, so call `heartbeat(step=n)` after each step and
    `heartbeat(step=n, checkpoint=True)` after a save. An attempt after a failure resumes from the
    last step so marked (without marks: from its own first step).

    Cheap (one `utime`, or one 96-byte `pwrite` with a step), safe to call every step, and a
    no-op outside a launch. The record (`host.heartbeat`): the step, this process's first
    step and the seconds since it, and the last save's step, duration and age; times are only
    differences on this host's clock, so the launcher places them on its own.
    """
    global _beat_fd, _beat_t, _saved, _first
    path = os.environ.get(HEARTBEAT_ENV)
    if not path:
        return
    now = time.monotonic()
    try:
        if step is None:
            os.utime(path)
            return
        if _first is None:
            _first = (int(step), now)
        if checkpoint:
            _saved = (int(step), now - _beat_t if _beat_t else 0.0, now)
        if _beat_fd is None or _beat_fd[0] != path:
            _beat_fd = (path, os.open(path, os.O_WRONLY))
        os.pwrite(_beat_fd[1], beat_record(int(step), _first, _saved, now), 0)  # the write is the mtime's update too
    except (OSError, ValueError, TypeError):
        pass
    finally:
        _beat_t = now
