"""`LaunchPlan` and `HostState`: what a launch is and what each host gets, as typed, frozen data.

`build_plan()` is a pure function of its arguments: `--dry-run` prints its result, tests compare
it field by field, and the run stages take nothing else.

A plan is three things that change at different rates:

* `Job`: what every host of the run shares from the first attempt to the last (script, framework,
  mesh, user environment);
* `HostSlot`: one host's place in it (process index, slice, TPU worker id, address);
* `Endpoints` and `attempt`: where the hosts meet this attempt (process 0's address and ports).
  A restart changes these fields and nothing else.

`HostState` is one host's contract: the job, its slot, the attempt and the endpoints. It is pickled
to the host; the environment the host process sees is derived from it by `plan.env.host_env()`,
and the framework adapters read its fields, never environment strings tpulaunch itself set.

Process index is the TPU worker id in physical order (plus `slice_index * hosts_per_slice` on
multislice), never the order Ray happened to schedule in.
"""

from __future__ import annotations

import datetime
import re
import secrets
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace

from tpulaunch.errors import LaunchError
from tpulaunch.plan import torch_tpu
from tpulaunch.plan.contract import MEGASCALE_PORT, Endpoints, HostSlot, HostState, Job
from tpulaunch.plan.env import host_env
from tpulaunch.plan.frameworks import Framework, facts
from tpulaunch.plan.mesh import MeshPlan, resize_slices
from tpulaunch.plan.slicespec import SliceSpec
from tpulaunch.plan.topology import Topology

_ENV_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,255}")  # fullmatch: no newline may trail a name


def default_compile_cache(framework: str | Framework, topology: Topology, num_slices: int,
                          emulated: bool) -> str | None:
    """`~/.cache/tpulaunch/xla-cache/<framework>/<slice>`, on each host's own disk (`~` is the host's).

    Emulated slices get their own directory: CPU compilations are no use on a TPU, and back.
    None for torch_xla: 2.9 writes cached executables but cannot load them on TPU or CPU
    ("Deserializing serialized executable not supported", pytorch/xla#9094), so a default cache
    would only cost disk and a warning per compile. `--compile-cache DIR` still turns it on.
    None too for a command or a script that boots no framework: nothing compiles.
    """
    if not facts(framework).compile_cache:
        return None
    key = f"{'emulated-' if emulated else ''}{topology.accelerator_type}-{topology.topology}"
    if num_slices > 1:
        key += f"-x{num_slices}"
    return f"~/.cache/tpulaunch/xla-cache/{Framework(framework).value}/{key}"


def run_marker(run_id: str) -> str:
    """The start of a file name every host process of run `run_id` holds open: /proc/<pid>/fd says
    which run a process serves, even a spare whose environment predates the run."""
    return f"tpulaunch-run-{run_id}-"


def new_run_id() -> str:
    """Sortable and unique: `20261121-223012-3f9a`."""
    now = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    return f"{now}-{secrets.token_hex(2)}"


MAX_ENV_FILE_BYTES = 1 << 20


def resolve_env(items: list[str] | tuple[str, ...] | None, files: list[str] | tuple[str, ...] | None,
                environ: Mapping[str, str], read: Callable[[str], str]) -> tuple[str, ...]:
    """`--env` and `--env-file` as `KEY=VALUE` items, resolved where the user typed them (pure but
    for `read`): `--env NAME` takes NAME's value from `environ`; a file is dotenv (`KEY=VALUE`,
    `export KEY=VALUE`, `#` comments, values in single or double quotes). Files first, flags win."""
    out: list[str] = []
    for path in files or ():
        text = read(path)
        for n, raw in enumerate(text.splitlines(), 1):
            line = raw.strip()
            if not line or line.startswith("#"):
                continue
            key, sep, value = line.removeprefix("export ").strip().partition("=")
            key, value = key.strip(), value.strip()
            if not sep or not _ENV_KEY.fullmatch(key):
                raise LaunchError(f"--env-file {path} line {n} is not KEY=VALUE", "write lines as NAME=value")
            if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
                value = value[1:-1]
            out.append(f"{key}={value}")
    for item in items or ():
        key, sep, _ = item.partition("=")
        if not sep:
            if not _ENV_KEY.fullmatch(key):
                raise LaunchError(f"--env {item[:80]!r} is not KEY=VALUE or NAME",
                                  "write it as --env NAME=value or --env NAME")
            if key not in environ:
                raise LaunchError(f"--env {key} takes its value from this environment, where {key} is not set",
                                  f"export {key}=... first, or write --env {key}=value")
            item = f"{key}={environ[key]}"
        out.append(item)
    return tuple(out)


def parse_env(items: list[str] | None) -> dict[str, str]:
    """`["K=V", ...]` from repeated `--env` flags."""
    out: dict[str, str] = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        if not sep or not _ENV_KEY.fullmatch(key):
            raise LaunchError(f"--env {item[:80]!r} is not KEY=VALUE", "write it as --env NAME=value")
        out[key] = value
    return out


@dataclass(frozen=True)
class LaunchPlan:
    """Every host of every slice for one attempt: the job, the slots, the meeting place."""

    job: Job
    slices: tuple[SliceSpec, ...]
    hosts: tuple[HostSlot, ...]  # by process index
    endpoints: Endpoints
    attempt: int = 0  # 0, then 1, 2, ... when the whole slice is restarted
    reason: str = "first"  # why this attempt runs (contract.ATTEMPT_REASONS)

    # The job's fields, for the stages that read them often.
    @property
    def run_id(self) -> str:
        return self.job.run_id

    @property
    def framework(self) -> str:
        return self.job.framework

    @property
    def mesh(self) -> MeshPlan:
        return self.job.mesh

    @property
    def topology(self) -> Topology:
        return self.job.mesh.topology

    @property
    def emulated(self) -> bool:
        """CPU devices stand in for the chips (an emulated slice, or `--cpu-devices`)."""
        return self.job.emulated

    @property
    def local(self) -> bool:
        """The hosts are this machine (an emulated cluster): they share its files and its ports."""
        return self.job.local

    @property
    def coordinator_address(self) -> str:
        return self.endpoints.coordinator_address

    def state(self, process_index: int) -> HostState:
        """The contract of the host with this process index."""
        return HostState(self.job, self.hosts[process_index], self.attempt, self.endpoints, self.reason)

    def states(self) -> list[HostState]:
        return [self.state(h.process_index) for h in self.hosts]

    def env(self, process_index: int) -> dict[str, str]:
        """The environment of that host's process (`plan.env.host_env` of its state)."""
        return host_env(self.state(process_index))

    def for_attempt(self, attempt: int, endpoints: Endpoints | None = None, reason: str = "restart") -> LaunchPlan:
        """The plan of restart number `attempt`, meeting at `endpoints` (default: the same). Pure."""
        return replace(self, attempt=attempt, endpoints=endpoints or self.endpoints, reason=reason)

    def on_fleet(self, keep: list[str], emulation_env: Mapping[str, str]) -> LaunchPlan:
        """The same job on the slices named in `keep` (a subset of the run's, in the run's order):
        the DCN axis of the mesh (the one spanning the slices) resized to them, slice ids and process
        indices renumbered, the meeting place on the first kept slice, and `emulation_env` (the
        adapter's for the new number of slices). Computed afresh from the job: nothing of the
        attempt before is carried over but the ports. Pure."""
        mesh = resize_slices(self.mesh, len(keep))
        slices = [replace(s, slice_index=i) for i, s in enumerate(s for s in self.slices if s.name in keep)]
        if [s.name for s in slices] != list(keep):
            raise LaunchError(f"internal: slices {list(keep)} are not the run's in its order", "report this bug")
        job = replace(self.job, mesh=mesh, full_num_slices=self.job.full_num_slices or self.mesh.num_slices,
                      emulation_env=dict(emulation_env) if self.job.emulated else {})
        return replace(self, job=job, slices=tuple(slices), hosts=_slots(slices, mesh.topology),
                       endpoints=replace(self.endpoints, host=slices[0].workers[0].ip))

    def swapped(self, swaps: Mapping[str, SliceSpec]) -> LaunchPlan:
        """The same job with slices swapped for others of the same shape (a spare taking a lost one's
        place): each new slice takes the old one's place (slice id, process indices), and every host
        slot and the meeting place follow its hosts. Pure."""
        slices = []
        for s in self.slices:
            new = swaps.get(s.name)
            if new is not None and len(new.workers) != len(s.workers):
                raise LaunchError(f"internal: spare {new.name} has {len(new.workers)} hosts, slice {s.name}"
                                  f" {len(s.workers)}", "report this bug")
            slices.append(replace(new, slice_index=s.slice_index) if new is not None else s)
        return replace(self, slices=tuple(slices), hosts=_slots(slices, self.topology),
                       endpoints=replace(self.endpoints, host=slices[0].workers[0].ip))

    def on_slices(self, slices: list[SliceSpec]) -> LaunchPlan:
        """The same job on these slices (a re-created slice: same name and shape, new VMs and
        addresses): every host slot and the meeting place follow the new addresses. Pure."""
        if [s.name for s in slices] != [s.name for s in self.slices]:
            raise LaunchError("internal: a re-created slice must keep its place in the run", "report this bug")
        return replace(self, slices=tuple(slices), hosts=_slots(slices, self.topology),
                       endpoints=replace(self.endpoints, host=slices[0].workers[0].ip))

    def to_dict(self) -> dict:
        j = self.job
        return {
            "schema": "tpulaunch.launch/v1",
            "run_id": j.run_id,
            "script": j.script,
            "args": list(j.args),
            "command": list(j.command),
            "framework": j.framework,
            "emulated": j.emulated,
            "local": j.local,
            "distributed": j.distributed,
            "coordinator_address": self.endpoints.coordinator_address,
            "group_address": self.endpoints.group_address,
            "log_dir": j.log_dir,
            "workdir": j.workdir,
            "attempt": self.attempt,
            "compile_cache": j.compile_cache,
            "topology": self.topology.to_dict(with_hosts=False),
            "num_slices": self.mesh.num_slices,
            "slices": [s.to_dict() for s in self.slices],
            "mesh": self.mesh.to_dict(devices=False),
            "hosts": [self._host_dict(h) for h in self.hosts],
        }

    def _host_dict(self, h: HostSlot) -> dict:
        doc = {"process_index": h.process_index, "slice_index": h.slice_index, "worker_id": h.worker_id,
               "slice_name": h.slice_name, "ip": h.ip, "env": self.env(h.process_index)}
        if facts(self.framework).per_device:  # one process per device: what each adds to the host's env
            doc["processes"] = [p.to_dict() for p in torch_tpu.processes(self.state(h.process_index))]
        return doc


def build_plan(
    *,
    slices: list[SliceSpec],
    mesh: MeshPlan,
    script: str,
    args: list[str] | tuple[str, ...] = (),
    framework: str | Framework = Framework.TORCH_XLA,
    user_env: Mapping[str, str] | None = None,
    run_id: str,
    coordinator_port: int,
    group_port: int | None = None,
    jax_coordinator_port: int | None = None,
    megascale_port: int = MEGASCALE_PORT,
    emulated: bool,
    emulation_env: Mapping[str, str] | None = None,
    emulation_port: int | None = None,
    exit_port: int | None = None,
    metadata_server: bool = False,
    distributed: bool = True,
    log_dir: str,
    workdir: str,
    command: tuple[str, ...] = (),
    compile_cache: str | None = None,
    python: str | None = None,
    local: bool | None = None,
    hang_s: float | None = None,
) -> LaunchPlan:
    """Plan a launch: one HostSlot per TPU host of every slice, meeting on slice 0's worker 0.

    `metadata_server` says whether the hosts can ask a GCE metadata server (real TPU VMs);
    without one (emulation, containers) the slice facts are pushed as `TPU_*` variables (see
    `plan.env`). `emulation_env` is what the framework adapter needs to emulate a host on CPU,
    applied when `emulated`; `emulation_port` is the port of the store emulated hosts use among
    themselves (per-host input is all-gathered over it); `exit_port` the one torch_xla hosts leave
    over in order (`host/leave.py`). `local`: the hosts are this machine (default: `emulated`).
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
    hosts = _slots(slices, topo)
    job = Job(
        run_id=run_id, script=script, args=tuple(args), framework=Framework(framework), mesh=mesh, emulated=emulated,
        distributed=distributed, metadata_server=metadata_server, log_dir=log_dir, workdir=workdir,
        command=tuple(command), compile_cache=compile_cache, python=python,
        emulation_env=dict(emulation_env or {}) if emulated else {}, user_env=dict(user_env or {}),
        local=emulated if local is None else local, hang_s=hang_s,
    )
    endpoints = Endpoints(
        host=slices[0].workers[0].ip, master_port=coordinator_port, group_port=group_port,
        jax_port=jax_coordinator_port, emulation_port=emulation_port if emulated else None,
        megascale_port=megascale_port, exit_port=exit_port,
    )
    return LaunchPlan(job=job, slices=tuple(slices), hosts=hosts, endpoints=endpoints)


def _slots(slices: list[SliceSpec], topo: Topology) -> tuple[HostSlot, ...]:
    """One slot per worker of every slice; process index = slice index x hosts per slice + worker id."""
    hosts = []
    for s_idx, s in enumerate(slices):
        ips = tuple(w.ip for w in s.workers)
        for w in s.workers:
            hosts.append(HostSlot(s_idx * topo.num_hosts + w.worker_id, s_idx, w.worker_id, s.name, w.ip, ips))
    return tuple(sorted(hosts, key=lambda h: h.process_index))
