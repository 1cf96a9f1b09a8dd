"""`SliceSpec`: what discovery found out about one TPU slice, whatever the source.

Every discovery source (Cloud TPU API, GCE metadata server, Ray node labels, command-line
flags for emulation) produces this same object, so planning code has one input type.
Pure data: picklable, JSON-able, no clients or sockets inside.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from tpulaunch.errors import TopologyError
from tpulaunch.plan import topology as topo_mod
from tpulaunch.plan.topology import Topology


@dataclass(frozen=True)
class WorkerEndpoint:
    """One TPU VM of the slice, in worker-id order."""

    worker_id: int
    ip: str  # internal IP (what hosts use to reach each other)
    external_ip: str | None = None
    hostname: str | None = None


@dataclass(frozen=True)
class SliceSpec:
    """A TPU slice as discovered. `source` says where the facts came from.

    `accelerator_type` / `topology` are kept as the source wrote them (a generation the
    installed client does not know, such as a future v8, stays a string); `to_topology()`
    turns them into a catalog `Topology`.
    """

    name: str
    accelerator_type: str  # e.g. v4-32, v6e-16, tpu7x-16
    topology: str  # e.g. 2x2x4, 4x4
    source: str  # "flags" | "tpu-api" | "metadata" | "ray" | "emulated-cluster"
    zone: str | None = None
    project: str | None = None
    state: str | None = None  # Cloud TPU Node.State name, e.g. READY
    health: str | None = None  # Node.Health name, e.g. HEALTHY
    health_description: str | None = None
    spot: bool = False
    preemptible: bool = False
    runtime_version: str | None = None
    workers: tuple[WorkerEndpoint, ...] = ()
    symptoms: tuple[str, ...] = ()
    queued_resource: str | None = None
    multislice_node: bool = False
    slice_index: int = 0  # position of this slice in a multislice set
    emulated: bool = False
    provenance: dict[str, str] = field(default_factory=dict)  # e.g. {"project": "GOOGLE_CLOUD_PROJECT"}

    def to_topology(self, chips_per_host: int | None = None) -> Topology:
        """The catalog Topology for this slice (raises TopologyError for unknown shapes).

        Where the shape alone leaves the hosts open (a v5e/v6e 2x4 is one VM through the Cloud TPU
        API, two on GKE or with `--chips-per-host 4`), the slice's own workers settle it."""
        topo = topo_mod.resolve(topology=self.topology or None, accelerator=self.accelerator_type,
                                chips_per_host=chips_per_host)
        n = len(self.workers)
        if chips_per_host is None and n and topo.num_hosts != n and topo.chips % n == 0:
            try:
                return topo_mod.resolve(topology=self.topology or None, accelerator=self.accelerator_type,
                                        chips_per_host=topo.chips // n)
            except TopologyError:
                pass  # no such form: the caller's check names the mismatch
        return topo

    @property
    def worker_ips(self) -> tuple[str, ...]:
        return tuple(w.ip for w in self.workers)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["schema"] = "tpulaunch.slice/v1"
        return d

    @staticmethod
    def from_dict(d: dict) -> SliceSpec:
        """The inverse of `to_dict` (a cluster record keeps its slices as JSON)."""
        fields = {k: v for k, v in d.items() if k in SliceSpec.__dataclass_fields__}
        fields["workers"] = tuple(WorkerEndpoint(**w) for w in d.get("workers", ()))
        fields["symptoms"] = tuple(d.get("symptoms", ()))
        return SliceSpec(**fields)

    @staticmethod
    def emulated_from(topology: Topology, name: str, slice_index: int = 0) -> SliceSpec:
        """The SliceSpec of a slice emulated on this machine (every host is 127.0.0.1)."""
        return SliceSpec(
            name=name,
            accelerator_type=topology.accelerator_type,
            topology=topology.topology,
            source="flags",
            state="READY",
            health="HEALTHY",
            workers=tuple(
                WorkerEndpoint(worker_id=w, ip="127.0.0.1", hostname=f"{name}-w-{w}")
                for w in range(topology.num_hosts)
            ),
            slice_index=slice_index,
            emulated=True,
        )
