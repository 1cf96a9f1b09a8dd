"""GCE metadata server -> `SliceSpec` of the TPU VM we run on.

The only module that talks to the metadata server: plain `urllib`, header `Metadata-Flavor:
Google`, short timeouts. We never probe it from a machine that is clearly not a TPU VM (no
`/dev/accel*`, no Google VFIO device, no override), so a laptop never waits on DNS for
`metadata.google.internal`.
"""

from __future__ import annotations

import glob
import math
import os
import re
import socket
import urllib.error
import urllib.request
from dataclasses import dataclass, field

from tpulaunch import settings
from tpulaunch.errors import MetadataError, TopologyError, TpulaunchError
from tpulaunch.plan import topology as topo_mod
from tpulaunch.plan.slicespec import SliceSpec, WorkerEndpoint

HOST_ENVS = ("TPULAUNCH_METADATA_HOST", "GCE_METADATA_HOST")
TIMEOUT_ENV = "TPULAUNCH_METADATA_TIMEOUT"
DEFAULT_HOST = "metadata.google.internal"
DEFAULT_TIMEOUT = 2.0
_GOOGLE_PCI_VENDOR = "0x1ae0"
_TPU_ENV_LINE = re.compile(r"^\s*([A-Za-z_][A-Za-z0-9_]*)\s*:\s*(.*?)\s*$")
_HINT = (
    "on a TPU VM it is metadata.google.internal; set TPULAUNCH_METADATA_HOST=host:port to use another,"
    " or name the slice (tpulaunch slice describe NAME --zone ZONE) to use the Cloud TPU API"
)


def metadata_host() -> tuple[str, str]:
    """(host[:port], where it came from)."""
    for env in HOST_ENVS:
        value = os.environ.get(env, "").strip()
        if value:
            return value.removeprefix("http://").rstrip("/"), env
    return DEFAULT_HOST, "default"


def metadata_timeout(timeout: float | None = None) -> float:
    """Per-request timeout: argument, then `TPULAUNCH_METADATA_TIMEOUT`, then 2 s."""
    if timeout is None:
        return settings.seconds(TIMEOUT_ENV, DEFAULT_TIMEOUT)
    if not math.isfinite(timeout) or timeout <= 0:
        raise TpulaunchError(f"metadata timeout must be a positive number of seconds, not {timeout:g}")
    return float(timeout)


def _google_vfio_groups() -> list[str]:
    groups = []
    for entry in glob.glob("/dev/vfio/*"):
        g = os.path.basename(entry)
        if not g.isdigit():
            continue
        for vendor in glob.glob(f"/sys/kernel/iommu_groups/{g}/devices/*/vendor"):
            try:
                with open(vendor) as f:
                    if f.read().strip().lower() == _GOOGLE_PCI_VENDOR:
                        groups.append(g)
                        break
            except OSError:
                continue
    return groups


def looks_like_tpu_vm() -> bool:
    """Worth asking the metadata server? An override is set, or TPU chips are visible (like Ray)."""
    if any(os.environ.get(env, "").strip() for env in HOST_ENVS):
        return True
    if any(not os.path.isdir(p) for p in glob.glob("/dev/accel*")):
        return True
    return bool(_google_vfio_groups())


class MetadataClient:
    """GET `/computeMetadata/v1/<path>`; a 404 is None, anything unreadable a MetadataError."""

    def __init__(self, host: str | None = None, timeout: float | None = None) -> None:
        self.host, self.host_source = (host, "argument") if host else metadata_host()
        self.timeout = metadata_timeout(timeout)
        self.base = f"http://{self.host}/computeMetadata/v1/"

    def get(self, path: str) -> str | None:
        req = urllib.request.Request(self.base + path, headers={"Metadata-Flavor": "Google"})
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as resp:  # fixed http base
                if resp.headers.get("Metadata-Flavor") != "Google":
                    raise MetadataError(
                        f"{self.base} answered without the Metadata-Flavor: Google header: not a metadata server",
                        _HINT,
                    )
                return resp.read().decode("utf-8", errors="replace")
        except urllib.error.HTTPError as e:
            if (e.headers.get("Metadata-Flavor") if e.headers else None) != "Google":
                raise MetadataError(
                    f"{self.base} answered HTTP {e.code} without the Metadata-Flavor: Google header:"
                    " not a metadata server",
                    _HINT,
                ) from None
            if e.code == 404:
                return None
            raise MetadataError(f"metadata server at {self.host} answered HTTP {e.code} for {path}", _HINT) from None
        except (urllib.error.URLError, TimeoutError, ConnectionError, OSError) as e:
            reason = getattr(e, "reason", e)
            if isinstance(reason, (socket.timeout, TimeoutError)):
                why = f"no answer within {self.timeout:g} s"
            else:
                why = " ".join(str(reason).split()) or type(reason).__name__
            raise MetadataError(f"metadata server unreachable at {self.host} ({why})", _HINT) from None


def parse_tpu_env(text: str) -> dict[str, str]:
    """`KEY: 'val'` lines -> dict. Lines that are not `KEY: value` are a MetadataError."""
    env: dict[str, str] = {}
    for line in text.splitlines():
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        m = _TPU_ENV_LINE.match(line)
        if not m:
            raise MetadataError(f"metadata key tpu-env has a malformed line: {line.strip()!r}", "expected KEY: 'value'")
        value = m.group(2)
        if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
            value = value[1:-1]
        env[m.group(1)] = value
    return env


def parse_worker_endpoints(text: str) -> tuple[WorkerEndpoint, ...]:
    """`host:uid:ip,...` (worker order) -> endpoints. A single-VM slice may give a bare hostname."""
    entries = [e.strip() for e in text.strip().split(",")]
    if entries and entries[-1] == "":
        entries.pop()
    if not entries:
        raise MetadataError("metadata key worker-network-endpoints is empty", "expected host:uid:ip,...")
    workers = []
    for i, entry in enumerate(entries):
        parts = entry.split(":")
        if len(parts) == 1 and parts[0] and " " not in parts[0]:
            workers.append(WorkerEndpoint(worker_id=i, ip=parts[0], hostname=parts[0]))
        elif len(parts) >= 3 and parts[2] and " " not in parts[2]:
            workers.append(WorkerEndpoint(worker_id=i, ip=parts[2], hostname=parts[0] or None))
        else:
            raise MetadataError(
                f"metadata key worker-network-endpoints has a malformed entry {entry!r} in {text.strip()!r}",
                "expected host:uid:ip,... (the IP is the third field)",
            )
    return tuple(workers)


def _int(key: str, value: str, minimum: int = 0) -> int:
    try:
        n = int(value.strip())
    except ValueError:
        n = -1
    if n < minimum:
        raise MetadataError(f"metadata key {key} is {value.strip()!r}, not a worker number")
    return n


@dataclass(frozen=True)
class LocalSlice:
    """What the metadata server says about this host: its slice, and which worker it is."""

    spec: SliceSpec
    worker_id: int
    tpu_env: dict[str, str] = field(default_factory=dict)


def read_local(timeout: float | None = None, *, host: str | None = None) -> LocalSlice | None:
    """Describe the slice this TPU VM belongs to; None when the server says this is no TPU VM."""
    md = MetadataClient(host, timeout)
    acc = md.get("instance/attributes/accelerator-type")
    env_text = md.get("instance/attributes/tpu-env")
    tpu_env = parse_tpu_env(env_text) if env_text else {}
    acc = (acc or tpu_env.get("ACCELERATOR_TYPE") or tpu_env.get("TPU_ACCELERATOR_TYPE") or "").strip()
    if not acc:
        return None  # a GCE VM, but not a TPU VM
    prov = {"source": f"metadata server {md.host} ({md.host_source})"}

    worker_text = md.get("instance/attributes/agent-worker-number")
    if worker_text is None:
        worker_text = tpu_env.get("WORKER_ID") or tpu_env.get("TPU_WORKER_ID")
        if worker_text is None:
            raise MetadataError("metadata key agent-worker-number is missing on a TPU VM", _HINT)
    worker_id = _int("agent-worker-number", worker_text)

    endpoints_text = md.get("instance/attributes/worker-network-endpoints")
    if endpoints_text is None:
        raise MetadataError("metadata key worker-network-endpoints is missing on a TPU VM", _HINT)
    workers = parse_worker_endpoints(endpoints_text)
    if worker_id >= len(workers):
        raise MetadataError(
            f"metadata key agent-worker-number is {worker_id} but worker-network-endpoints lists {len(workers)} workers"
        )

    shape = tpu_env.get("TOPOLOGY", "").strip()
    if shape:
        try:
            topo_mod.parse_shape(shape)
        except TopologyError:
            raise MetadataError(f"metadata key tpu-env has TOPOLOGY {shape!r}, not a shape like 2x2x4") from None
        prov["topology"] = "tpu-env TOPOLOGY"
    else:
        try:
            shape = topo_mod.parse_accelerator_type(acc).topology
            prov["topology"] = f"catalog default shape for {acc}"
        except TopologyError:
            shape = ""

    name = (md.get("instance/attributes/instance-id") or tpu_env.get("NODE_ID") or "").strip()
    zone_text = md.get("instance/zone")
    zone = zone_text.strip().rsplit("/", 1)[-1] if zone_text else tpu_env.get("ZONE") or None
    project = (md.get("project/project-id") or "").strip() or tpu_env.get("CONSUMER_PROJECT_ID") or None
    if zone:
        prov["zone"] = "metadata instance/zone" if zone_text else "tpu-env ZONE"
    if project:
        prov["project"] = "metadata project/project-id"
    preempted = (md.get("instance/preempted") or "").strip().upper() == "TRUE"
    preemptible = (md.get("instance/scheduling/preemptible") or "").strip().upper() == "TRUE"

    slice_index = 0
    num_slices = 1
    if "MEGASCALE_SLICE_ID" in tpu_env:
        slice_index = _int("tpu-env MEGASCALE_SLICE_ID", tpu_env["MEGASCALE_SLICE_ID"])
    if "MEGASCALE_NUM_SLICES" in tpu_env:
        num_slices = _int("tpu-env MEGASCALE_NUM_SLICES", tpu_env["MEGASCALE_NUM_SLICES"], minimum=1)

    spec = SliceSpec(
        name=name or (workers[0].hostname or "local-tpu"),
        accelerator_type=acc,
        topology=shape,
        source="metadata",
        zone=zone,
        project=project,
        state="PREEMPTED" if preempted else None,  # the metadata server does not report READY
        preemptible=preemptible,
        workers=workers,
        multislice_node=num_slices > 1,
        slice_index=slice_index,
        provenance=prov,
    )
    return LocalSlice(spec=spec, worker_id=worker_id, tpu_env=tpu_env)
