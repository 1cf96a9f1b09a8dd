"""TorchTPU's launch contract, computed from the slice: one process per TPU device.

torch-tpu 0.2.0 (PyTorch's native TPU backend: device "tpu", process group "tpu_dist") ships no
launcher. Its PJRT client refuses to start unless every process has `RANK`, `LOCAL_RANK`,
`WORLD_SIZE`, `MASTER_ADDR`, `MASTER_PORT`, `TORCH_TPU_SLICEBUILDER_ADDRESSES` and
`TORCH_TPU_TOPOLOGY`, and it takes rank r's slice-builder address as `addresses[r % n]`: ranks
must be host-major in the order of the addresses, local index = `LOCAL_RANK`. Its own parent-side
helper (`torch.tpu.distributed.set_tpu_launch_env`) cannot find a multi-host slice's topology on a
plain TPU VM and assumes 2x2x1 chips per host; tpulaunch knows every host's place, so it computes
the whole contract here (pure; `tests/unit/golden/torch_tpu_launch_env.json` holds what the
wheel's own function writes for the same hosts, and the unit tests compare).

* Ranks: global rank = process index (slice-major, then worker id) x devices per host + local
  index; local index = the host's chips in `Topology.host_chips` order, then the core (v7x). This
  is also the mesh's device id (`MeshPlan.device`), so `get_mesh()` is the plan's grid of ranks.
* Ports (torch_tpu's fixed ones; nothing of tpulaunch's may take them, see `cluster.ports`):
  slice builder 8070+i, MegaScale 8080+2i and debug 8081+2i per local rank, `MASTER_PORT` 29500,
  the compiled-collective handshake 36423. An emulated slice has every host on one address, so
  there the slice-builder ports go on per host (nothing binds them on CPU).
* Multislice: one `MASTER_ADDR` and global ranks; per slice its own addresses and topology;
  `MEGASCALE_COORDINATOR_ADDRESS` carries its port (8080: local rank 0 of the coordinator host).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from tpulaunch.errors import LaunchError
from tpulaunch.plan.contract import HostState
from tpulaunch.plan.frameworks import TORCH_TPU_MASTER_PORT
from tpulaunch.plan.topology import Topology

SLICEBUILDER_BASE_PORT = 8070  # TORCH_TPU_BASE_PORT's default
MASTER_PORT = TORCH_TPU_MASTER_PORT  # set_tpu_launch_env's MASTER_PORT
MEGASCALE_BASE_PORT = 8080  # the runtime sets MEGASCALE_PORT = 8080 + 2 x LOCAL_RANK on multislice
HANDSHAKE_PORT = 36423  # TORCH_TPU_INTERNAL_HANDSHAKE_PORT's default, on rank 0
FIXED_PORTS = frozenset({MASTER_PORT, HANDSHAKE_PORT})  # the ones in the range tpulaunch picks from
GENERATIONS = ("v4", "v5e", "v5p", "v6e", "v7x")  # the PCI ids torch-tpu 0.2.0 knows


def check_generation(topology: Topology) -> None:
    """torch-tpu 0.2.0 finds v4, v5e, v5p, v6e and v7x chips only."""
    if topology.generation.name not in GENERATIONS:
        raise LaunchError(
            f"--framework torch_tpu does not run on {topology.generation.name}: torch-tpu 0.2.0 supports "
            + ", ".join(GENERATIONS),
            "use --framework torch_xla or jax on this generation",
        )


def topology_string(topology: Topology) -> str:
    """`TORCH_TPU_TOPOLOGY`: the slice's chip bounds, comma-separated as the runtime splits them
    (`4,4,4`; 2-D slices `4,4,1`); on v7x a 4th field, the devices per chip (`2,2,2,2`)."""
    fields = list(topology.shape)
    if topology.generation.devices_per_chip > 1:
        fields.append(topology.generation.devices_per_chip)
    return ",".join(str(f) for f in fields)


def xprof_session_id(run_id: str, attempt: int) -> str:
    """One profiler session id for every process of an attempt (the wheel's default, the parent's
    clock, differs per host). Digits, as the default is."""
    return str(int.from_bytes(hashlib.sha256(f"{run_id}/{attempt}".encode()).digest()[:7], "big"))


@dataclass(frozen=True)
class Process:
    """One torch_tpu process of a host: its ranks and the environment it adds to its host's."""

    rank: int
    local_rank: int
    env: dict[str, str]

    def to_dict(self) -> dict:
        return {"rank": self.rank, "local_rank": self.local_rank, "env": dict(self.env)}


def slicebuilder_addresses(state: HostState) -> str:
    """Every device of this host's slice, host-major in worker-id order (the same on every host)."""
    per_host = state.job.topology.devices_per_host
    out: list[str] = []
    for w, ip in enumerate(state.slot.slice_ips):
        first = SLICEBUILDER_BASE_PORT + (w * per_host if state.job.emulated else 0)
        out.extend(f"{ip}:{first + i}" for i in range(per_host))
    return ",".join(out)


def processes(state: HostState) -> list[Process]:
    """The processes of the host of `state`, by local rank. Pure."""
    topo = state.job.topology
    per_host = topo.devices_per_host
    ends = state.endpoints
    node = state.slot.process_index
    common = {
        "WORLD_SIZE": str(state.num_processes * per_host),
        "LOCAL_WORLD_SIZE": str(per_host),
        "NNODES": str(state.num_processes),
        "NODE_RANK": str(node),
        "GROUP_RANK": str(node),
        "MASTER_ADDR": ends.host,
        "MASTER_PORT": str(ends.master_port),
        "TORCH_TPU_SLICEBUILDER_ADDRESSES": slicebuilder_addresses(state),
        "TORCH_TPU_TOPOLOGY": topology_string(topo),
        "TORCH_TPU_DEVICES_PER_HOST": str(per_host),
        "TORCH_TPU_XPROF_SESSION_ID": xprof_session_id(state.run_id, state.attempt),
    }
    if state.num_slices > 1:
        common.update({
            "MEGASCALE_COORDINATOR_ADDRESS": f"{ends.host}:{MEGASCALE_BASE_PORT}",
            "MEGASCALE_NUM_SLICES": str(state.num_slices),
            "MEGASCALE_SLICE_ID": str(state.slice_index),
        })
    out = []
    for local in range(per_host):
        rank = node * per_host + local
        env = {**common, "RANK": str(rank), "LOCAL_RANK": str(local)}
        if state.num_slices > 1:  # what the runtime will set anyway, so the script sees it from the start
            env["MEGASCALE_PORT"] = str(MEGASCALE_BASE_PORT + 2 * local)
            env["MEGASCALE_DEBUG_PORT"] = str(MEGASCALE_BASE_PORT + 1 + 2 * local)
        for key in state.job.user_env:  # the user's --env wins, as on the host
            env.pop(key, None)
        out.append(Process(rank, local, env))
    return out
