"""`LaunchPlan`: everything each host needs, as pure data, built without touching anything.

`build_plan()` is a pure function of its arguments: `--dry-run` prints its result, tests
compare it field by field, and `tpulaunch.run.execute` takes nothing else.

Process index is the TPU worker id in physical order (plus `slice_index * hosts_per_slice` on
multislice), never the order Ray happened to schedule in.
"""

from __future__ import annotations

import datetime
import re
import secrets
from dataclasses import asdict, dataclass, field, replace

from tpulaunch.errors import LaunchError
from tpulaunch.plan.mesh import MeshPlan
from tpulaunch.plan.slicespec import SliceSpec
from tpulaunch.plan.topology import Topology

MEGASCALE_PORT = 8081  # libtpu's DCN coordinator port (Ray and MaxText use the same)
_ENV_KEY = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def default_compile_cache(framework: str, topology: Topology, num_slices: int, emulated: bool) -> str | None:
    """`~/.cache/tpulaunch/xla-cache/<framework>/<slice>`, on each host's own disk (`~` is the host's).

    Emulated slices get their own directory: CPU compilations are no use on a TPU, and back.
    None for torch_xla: 2.9 writes cached executables but cannot load them on TPU or CPU
    ("Deserializing serialized executable not supported", pytorch/xla#9094), so a default cache
    would only cost disk and a warning per compile. `--compile-cache DIR` still turns it on.
    """
    if framework == "torch_xla":
        return None
    key = f"{'emulated-' if emulated else ''}{topology.accelerator_type}-{topology.topology}"
    if num_slices > 1:
        key += f"-x{num_slices}"
    return f"~/.cache/tpulaunch/xla-cache/{framework}/{key}"


def run_marker(run_id: str) -> str:
    """The start of a file name every host process of run `run_id` holds open: /proc/<pid>/fd says
    which run a process serves, even a spare whose environment predates the run."""
    return f"tpulaunch-run-{run_id}-"


def new_run_id() -> str:
    """Sortable and unique: `20261121-223012-3f9a`."""
    now = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    return f"{now}-{secrets.token_hex(2)}"


def parse_env(items: list[str] | None) -> dict[str, str]:
    """`["K=V", ...]` from repeated `--env` flags."""
    out: dict[str, str] = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        if not sep or not _ENV_KEY.match(key):
            raise LaunchError(f"--env '{item}' is not KEY=VALUE", "write it as --env NAME=value")
        out[key] = value
    return out


@dataclass(frozen=True)
class HostLaunch:
    """One host process of the launch."""

    process_index: int
    slice_index: int
    worker_id: int
    slice_name: str
    ip: str
    env: dict[str, str]


@dataclass(frozen=True)
class LaunchPlan:
    run_id: str
    script: str
    args: tuple[str, ...]
    framework: str
    mesh: MeshPlan
    slices: tuple[SliceSpec, ...]
    hosts: tuple[HostLaunch, ...]
    emulated: bool
    coordinator_address: str
    distributed: bool
    log_dir: str
    workdir: str
    command: tuple[str, ...] = ()  # set for `tpulaunch exec`: run this instead of a script
    attempt: int = 0  # 0, then 1, 2, ... when the whole slice is restarted
    compile_cache: str | None = None  # persistent XLA compilation cache dir on each host ("~" is the host's)
    # host:port of the store of tpulaunch's own gloo group (build_plan: the coordinator's unless a
    # group port is given). Not MASTER_PORT: a script that destroys the group and makes its own over
    # env:// would otherwise race the old listener on that port.
    group_address: str = ""

    @property
    def topology(self) -> Topology:
        return self.mesh.topology

    def for_attempt(self, attempt: int, *, coordinator_port: int | None = None, group_port: int | None = None,
                    jax_coordinator_port: int | None = None, emulation_port: int | None = None) -> "LaunchPlan":
        """The plan of restart number `attempt`: a new process group (new ports, if given) and
        `TPULAUNCH_RESTART_COUNT`, everything else as planned. Pure."""
        host0 = self.coordinator_address.rsplit(":", 1)[0]
        coordinator = f"{host0}:{coordinator_port}" if coordinator_port else self.coordinator_address
        group = f"{host0}:{group_port}" if group_port else self.group_address
        hosts = []
        for h in self.hosts:
            env = dict(h.env, TPULAUNCH_RESTART_COUNT=str(attempt), TPULAUNCH_COORDINATOR_ADDRESS=coordinator,
                       TPULAUNCH_GROUP_ADDRESS=group)
            if coordinator_port:
                env["MASTER_PORT"] = str(coordinator_port)
            if jax_coordinator_port and "JAX_COORDINATOR_ADDRESS" in env:
                env["JAX_COORDINATOR_ADDRESS"] = f"{host0}:{jax_coordinator_port}"
            if emulation_port and "TPULAUNCH_EMULATION_PORT" in env:
                env["TPULAUNCH_EMULATION_PORT"] = str(emulation_port)
            hosts.append(replace(h, env=env))
        return replace(self, hosts=tuple(hosts), coordinator_address=coordinator, group_address=group, attempt=attempt)

    def to_dict(self) -> dict:
        return {
            "schema": "tpulaunch.launch/v1",
            "run_id": self.run_id,
            "script": self.script,
            "args": list(self.args),
            "command": list(self.command),
            "framework": self.framework,
            "emulated": self.emulated,
            "distributed": self.distributed,
            "coordinator_address": self.coordinator_address,
            "group_address": self.group_address,
            "log_dir": self.log_dir,
            "workdir": self.workdir,
            "attempt": self.attempt,
            "compile_cache": self.compile_cache,
            "topology": self.topology.to_dict(with_hosts=False),
            "num_slices": self.mesh.num_slices,
            "slices": [s.to_dict() for s in self.slices],
            "mesh": self.mesh.to_dict(devices=False),
            "hosts": [asdict(h) for h in self.hosts],
        }


@dataclass(frozen=True)
class HostState:
    """What one host's bootstrap process unpickles: its part of the plan plus the mesh plan."""

    run_id: str
    process_index: int
    num_processes: int
    worker_id: int
    slice_index: int
    num_slices: int
    slice_name: str
    accelerator_type: str
    topology: str
    coordinator_address: str
    framework: str
    emulated: bool
    distributed: bool
    log_dir: str
    script: str
    args: tuple[str, ...]
    mesh: MeshPlan
    command: tuple[str, ...] = ()
    extra: dict = field(default_factory=dict)
    restart_count: int = 0
    compile_cache: str | None = None
    group_address: str = ""  # tpulaunch's gloo group store (LaunchPlan.group_address)

    @staticmethod
    def for_host(plan: LaunchPlan, host: HostLaunch) -> "HostState":
        return HostState(
            run_id=plan.run_id,
            process_index=host.process_index,
            num_processes=len(plan.hosts),
            worker_id=host.worker_id,
            slice_index=host.slice_index,
            num_slices=plan.mesh.num_slices,
            slice_name=host.slice_name,
            accelerator_type=plan.topology.accelerator_type,
            topology=plan.topology.topology,
            coordinator_address=plan.coordinator_address,
            framework=plan.framework,
            emulated=plan.emulated,
            distributed=plan.distributed,
            log_dir=plan.log_dir,
            script=plan.script,
            args=plan.args,
            mesh=plan.mesh,
            command=plan.command,
            restart_count=plan.attempt,
            compile_cache=plan.compile_cache,
            group_address=plan.group_address,
        )


def build_plan(
    *,
    slices: list[SliceSpec],
    mesh: MeshPlan,
    script: str,
    args: list[str] | tuple[str, ...] = (),
    framework: str = "torch_xla",
    user_env: dict[str, str] | None = None,
    run_id: str,
    coordinator_port: int,
    group_port: int | None = None,
    jax_coordinator_port: int | None = None,
    megascale_port: int = MEGASCALE_PORT,
    emulated: bool,
    emulation_env: dict[str, str] | None = None,
    emulation_port: int | None = None,
    metadata_server: bool = False,
    distributed: bool = True,
    log_dir: str,
    workdir: str,
    command: tuple[str, ...] = (),
    compile_cache: str | None = None,
) -> LaunchPlan:
    """Plan a launch: one HostLaunch per TPU host of every slice, with its full environment.

    `metadata_server` says whether the hosts can ask a GCE metadata server (real TPU VMs);
    without one (emulation, containers) the slice facts are pushed as `TPU_*` variables with
    `TPU_SKIP_MDS_QUERY=1`, the fallback torch_xla and libtpu honour. `emulation_env` is what
    the framework adapter needs to emulate a host on CPU (`Framework.emulation_env`), applied
    when `emulated`; `emulation_port` is the port of the store emulated hosts use among
    themselves (per-host input is all-gathered over it).
    """
    topo = mesh.topology
    if len(slices) != mesh.num_slices:
        raise LaunchError(f"{len(slices)} slices found but the mesh spans {mesh.num_slices}", "check --num-slices")
    for s in slices:
        if len(s.workers) != topo.num_hosts:
            raise LaunchError(
                f"slice {s.name} lists {len(s.workers)} workers but {topo.accelerator_type} has {topo.num_hosts} hosts",
                "the slice does not match its topology; describe it with `tpulaunch slice describe`",
            )
    first = slices[0].workers[0].ip
    coordinator = f"{first}:{coordinator_port}"
    group = f"{first}:{group_port}" if group_port else coordinator
    n_proc = topo.num_hosts * len(slices)
    hosts = []
    for s_idx, s in enumerate(slices):
        hostnames = ",".join(w.ip for w in s.workers)
        for w in s.workers:
            proc = s_idx * topo.num_hosts + w.worker_id
            env: dict[str, str] = {
                "TPULAUNCH_RUN_ID": run_id,
                "TPULAUNCH_PROCESS_INDEX": str(proc),
                "TPULAUNCH_NUM_PROCESSES": str(n_proc),
                "TPULAUNCH_COORDINATOR_ADDRESS": coordinator,
                "TPULAUNCH_GROUP_ADDRESS": group,
                "TPULAUNCH_EMULATED": "1" if emulated else "0",
                "TPULAUNCH_RESTART_COUNT": "0",
                "TPULAUNCH_FRAMEWORK": framework,
                # torch.distributed (gloo) and anything reading the usual names
                "MASTER_ADDR": first,
                "MASTER_PORT": str(coordinator_port),
                "RANK": str(proc),
                "WORLD_SIZE": str(n_proc),
                "LOCAL_RANK": "0",
                "LOCAL_WORLD_SIZE": "1",
                # what libtpu / torch_xla / JAX's GKE cluster detection read
                "TPU_WORKER_ID": str(w.worker_id),
                "TPU_WORKER_HOSTNAMES": hostnames,
                "TPU_ACCELERATOR_TYPE": topo.accelerator_type,
                "TPU_NAME": s.name,
                "PJRT_DEVICE": "TPU",
                "PYTHONUNBUFFERED": "1",
            }
            if not metadata_server:
                env.update(
                    {
                        "TPU_SKIP_MDS_QUERY": "1",
                        "TPU_TOPOLOGY": topo.topology,
                        "TPU_HOST_BOUNDS": topo.bounds_str(topo.host_bounds),
                        "TPU_CHIPS_PER_HOST_BOUNDS": topo.bounds_str(topo.chips_per_host_bounds),
                    }
                )
            if jax_coordinator_port is not None:
                env["JAX_COORDINATOR_ADDRESS"] = f"{first}:{jax_coordinator_port}"
                env["JAX_NUM_PROCESSES"] = str(n_proc)
                env["JAX_PROCESS_ID"] = str(proc)
            if len(slices) > 1:
                env.update(
                    {
                        "MEGASCALE_COORDINATOR_ADDRESS": first,
                        "MEGASCALE_PORT": str(megascale_port),
                        "MEGASCALE_NUM_SLICES": str(len(slices)),
                        "MEGASCALE_SLICE_ID": str(s_idx),
                    }
                )
            if emulated:
                env.update(emulation_env or {})
                if emulation_port is not None:
                    env["TPULAUNCH_EMULATION_PORT"] = str(emulation_port)
            env.update(user_env or {})
            hosts.append(HostLaunch(proc, s_idx, w.worker_id, s.name, w.ip, env))
    hosts.sort(key=lambda h: h.process_index)
    return LaunchPlan(
        run_id=run_id,
        script=script,
        args=tuple(args),
        framework=framework,
        mesh=mesh,
        slices=tuple(slices),
        hosts=tuple(hosts),
        emulated=emulated,
        coordinator_address=coordinator,
        group_address=group,
        distributed=distributed,
        log_dir=log_dir,
        workdir=workdir,
        command=command,
        compile_cache=compile_cache,
    )
