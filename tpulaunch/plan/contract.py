"""One host's contract, as typed, frozen data: `Job` (what every host of a run shares), `HostSlot`
(one host's place), `Endpoints` (where the hosts meet this attempt) and `HostState`, the four
together: what is pickled to the host. `plan.env` derives the host's environment from a
`HostState`; `plan.launch` builds them (`LaunchPlan`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace

from tpulaunch.plan.frameworks import Framework
from tpulaunch.plan.mesh import MeshPlan
from tpulaunch.plan.topology import Topology

ATTEMPT_REASONS = ("first", "restart", "preemption", "shrink", "grow")
MEGASCALE_PORT = 8081  # libtpu's DCN coordinator port (Ray and MaxText use the same)


@dataclass(frozen=True)
class Endpoints:
    """Where the hosts of one attempt meet, all on process 0's host. A new attempt may move them.

    `master_port` is `MASTER_PORT` (a script's own `env://` group); tpulaunch's own gloo group keeps
    its store on `group_port`, so a script that destroys that group and makes its own never races
    a listener that is closing (None: the store shares `master_port`, as under Ray Train).
    """

    host: str
    master_port: int
    group_port: int | None = None
    jax_port: int | None = None  # JAX's coordinator (jax.distributed), when the framework is JAX
    emulation_port: int | None = None  # emulated torch_xla hosts' own store (per-host input)
    exit_port: int | None = None  # torch_xla hosts leave in order over it, process 0 last (host/leave.py)
    megascale_port: int = MEGASCALE_PORT

    @property
    def coordinator_address(self) -> str:
        return f"{self.host}:{self.master_port}"

    @property
    def group_address(self) -> str:
        return f"{self.host}:{self.group_port or self.master_port}"

    @property
    def jax_address(self) -> str | None:
        return f"{self.host}:{self.jax_port}" if self.jax_port is not None else None

    def moved(self, *, master_port: int | None = None, group_port: int | None = None, jax_port: int | None = None,
              emulation_port: int | None = None, exit_port: int | None = None) -> Endpoints:
        """The same meeting place with the given ports replaced (a restart on one machine)."""
        return replace(
            self,
            master_port=master_port or self.master_port,
            group_port=group_port or self.group_port,
            jax_port=jax_port if (jax_port and self.jax_port is not None) else self.jax_port,
            emulation_port=(emulation_port if (emulation_port and self.emulation_port is not None)
                            else self.emulation_port),
            exit_port=exit_port if (exit_port and self.exit_port is not None) else self.exit_port,
        )


@dataclass(frozen=True)
class Job:
    """What every host of a run shares, from its first attempt to its last."""

    run_id: str
    script: str
    args: tuple[str, ...]
    framework: Framework
    mesh: MeshPlan
    emulated: bool
    distributed: bool  # open tpulaunch's gloo group across the hosts
    metadata_server: bool  # the hosts can ask a GCE metadata server (real TPU VMs)
    log_dir: str
    workdir: str
    command: tuple[str, ...] = ()  # `tpulaunch exec`: run this instead of a script
    compile_cache: str | None = None  # persistent XLA compilation cache dir on each host ("~" is the host's)
    python: str | None = None  # the interpreter the host process runs in (None: the agent's, Ray's)
    full_num_slices: int = 0  # the slices the run asked for (0: the mesh's); more than this attempt's after a shrink
    # the hosts are this machine (an emulated cluster: shared files, ports chosen here). `emulated`
    # with `local` False: CPU devices stand in for the chips on a real cluster's hosts (`--cpu-devices`)
    local: bool = False
    hang_s: float | None = None  # libtpu's Megascale hang threshold on real multislice hosts (--stall-timeout)
    emulation_env: Mapping[str, str] = field(default_factory=dict)  # the adapter's CPU emulation of a host
    user_env: Mapping[str, str] = field(default_factory=dict)  # --env, applied last

    @property
    def topology(self) -> Topology:
        return self.mesh.topology


@dataclass(frozen=True)
class HostSlot:
    """One host's place in the launch."""

    process_index: int
    slice_index: int
    worker_id: int
    slice_name: str
    ip: str
    slice_ips: tuple[str, ...]  # every worker of its slice in worker-id order (TPU_WORKER_HOSTNAMES)


@dataclass(frozen=True)
class HostState:
    """One host's whole contract: its slot in the job, this attempt, and where the hosts meet.

    Pickled to the host process (and to a Ray Train worker); `tpulaunch.context()` is a view of it.
    """

    job: Job
    slot: HostSlot
    attempt: int
    endpoints: Endpoints
    reason: str = "first"  # why this attempt runs: first, restart, preemption, shrink, grow (ATTEMPT_REASONS)

    # Read-only views of the fields, named as a host's code asks for them.
    @property
    def run_id(self) -> str:
        return self.job.run_id

    @property
    def framework(self) -> Framework:
        return self.job.framework

    @property
    def mesh(self) -> MeshPlan:
        return self.job.mesh

    @property
    def emulated(self) -> bool:
        return self.job.emulated

    @property
    def process_index(self) -> int:
        return self.slot.process_index

    @property
    def num_processes(self) -> int:
        return self.job.mesh.num_processes

    @property
    def worker_id(self) -> int:
        return self.slot.worker_id

    @property
    def slice_index(self) -> int:
        return self.slot.slice_index

    @property
    def num_slices(self) -> int:
        return self.job.mesh.num_slices

    @property
    def slice_name(self) -> str:
        return self.slot.slice_name
