"""Describe real slices: a node or queued resource from the Cloud TPU API, or this TPU VM's slice
from the metadata server; and check a slice found against the flags and for readiness.

Sources, each in its own module (one external system per module):

* `tpu_api`: the Cloud TPU API (from a laptop, CI, or any host with credentials);
* `metadata`: the GCE metadata server (on a TPU VM, no credentials needed);
* `tpulaunch.gcloud` (shared with `cluster/`: the one module that runs gcloud): the active gcloud
  configuration, for project/zone defaults only.

Everything returns a `SliceSpec`; nothing here imports google.cloud at module load.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from tpulaunch.errors import DiscoveryError, SliceMismatchError, SliceNotReadyError, TopologyError, TpulaunchError
from tpulaunch.plan import topology as topo_mod
from tpulaunch.plan.catalog import TYPE_RE
from tpulaunch.plan.slicespec import SliceSpec

if TYPE_CHECKING:
    from tpulaunch.discover.metadata import LocalSlice

PROJECT_ENVS = ("GOOGLE_CLOUD_PROJECT", "CLOUDSDK_CORE_PROJECT")
ZONE_ENVS = ("CLOUDSDK_COMPUTE_ZONE",)

# -- project / zone ------------------------------------------------------------------------------


def resolve_project_zone(
    project: str | None, zone: str | None
) -> tuple[str | None, str | None, dict[str, str]]:
    """Project and zone from flags, then env, then the active gcloud config; provenance says which.

    gcloud is only asked for what is still missing, so a fully specified command never runs it.
    """
    from tpulaunch import gcloud

    prov: dict[str, str] = {}

    def pick(value: str | None, flag: str, envs: tuple[str, ...], gcloud_key: str, key: str) -> str | None:
        if value:
            prov[key] = f"{flag} flag"
            return value
        for env in envs:
            if os.environ.get(env, "").strip():
                prov[key] = f"env {env}"
                return os.environ[env].strip()
        found = gcloud.config_get(gcloud_key)
        if found:
            prov[key] = f"gcloud config {gcloud_key}"
            return found
        return None

    p = pick(project, "--project", PROJECT_ENVS, "project", "project")
    z = pick(zone, "--zone", ZONE_ENVS, "compute/zone", "zone")
    return p, z, prov


def require_project_zone(
    project: str | None, zone: str | None, what: str
) -> tuple[str, str, dict[str, str]]:
    p, z, prov = resolve_project_zone(project, zone)
    if not p or not z:
        missing = [k for k, v in (("project", p), ("zone", z)) if not v]
        hints = {
            "project": "--project P (or GOOGLE_CLOUD_PROJECT, or `gcloud config set project P`)",
            "zone": "--zone Z (or CLOUDSDK_COMPUTE_ZONE, or `gcloud config set compute/zone Z`)",
        }
        raise DiscoveryError(
            f"no {' or '.join(missing)} to look up {what} in",
            "pass " + " and ".join(hints[k] for k in missing),
        )
    return p, z, prov


# -- Cloud TPU API -------------------------------------------------------------------------------


def describe_node(
    name: str,
    *,
    zone: str | None = None,
    project: str | None = None,
    timeout: float | None = None,
    endpoint: str | None = None,
) -> SliceSpec:
    """One TPU node from the Cloud TPU API. `name` is a node id or `projects/P/locations/Z/nodes/N`."""
    from tpulaunch.discover import tpu_api

    p_path, z_path, node = tpu_api.split_node_path(name)
    for flag, given, in_path in (("--project", project, p_path), ("--zone", zone, z_path)):
        if given and in_path and given != in_path:
            raise TpulaunchError(f"{flag} {given} contradicts the node path {name}", f"drop {flag}")
    p, z, prov = require_project_zone(project or p_path, zone or z_path, f"TPU node '{node}'")
    if p_path:
        prov.update(project="node path", zone="node path")
    return tpu_api.get_node_spec(p, z, node, timeout=timeout, endpoint=endpoint, provenance=prov)


def describe_queued_resource(
    name: str,
    *,
    zone: str | None = None,
    project: str | None = None,
    timeout: float | None = None,
    endpoint: str | None = None,
) -> list[SliceSpec]:
    """The slices of a queued resource (one per node, `slice_index` set) for multislice runs."""
    from tpulaunch.discover import tpu_api

    qr = name.rsplit("/", 1)[-1]
    p, z, prov = require_project_zone(project, zone, f"queued resource '{qr}'")
    return tpu_api.queued_resource_specs(p, z, qr, timeout=timeout, endpoint=endpoint, provenance=prov)


def list_nodes(
    *,
    zone: str | None = None,
    project: str | None = None,
    timeout: float | None = None,
    endpoint: str | None = None,
    page_size: int | None = None,
) -> list[SliceSpec]:
    """Every TPU node of a zone (`-` means all zones), across all result pages."""
    from tpulaunch.discover import tpu_api

    p, z, prov = require_project_zone(project, zone, "TPU nodes")
    return tpu_api.list_node_specs(p, z, timeout=timeout, endpoint=endpoint, page_size=page_size, provenance=prov)


# -- metadata server -----------------------------------------------------------------------------


def local_host(timeout: float | None = None) -> LocalSlice | None:
    """This host's slice and worker id: in a GKE TPU pod from the variables GKE and the KubeRay TPU
    webhook set, on a TPU VM from the metadata server; None when clearly neither."""
    import os

    from tpulaunch.discover import gke, metadata

    in_pod = gke.local_slice(os.environ)
    if in_pod is not None:
        return metadata.LocalSlice(in_pod[0], in_pod[1])
    if not metadata.looks_like_tpu_vm():
        return None
    return metadata.read_local(timeout)


def local_slice(timeout: float | None = None) -> SliceSpec | None:
    """The slice this TPU VM belongs to (metadata server), or None when clearly not on a TPU VM."""
    local = local_host(timeout)
    return local.spec if local else None


# -- checks --------------------------------------------------------------------------------------

def generation_of(spec: SliceSpec) -> str | None:
    """Catalog generation name (`v5e` for `v5litepod-16`), or the raw prefix if we do not know it."""
    m = TYPE_RE.match(spec.accelerator_type.strip().lower())
    prefix = m.group(1) if m else spec.accelerator_type.strip().lower()
    if not prefix:
        return None
    try:
        return topo_mod.generation(prefix).name
    except TopologyError:
        return prefix


def _norm_type(text: str) -> str:
    m = TYPE_RE.match(text.strip().lower())
    if not m:
        return text.strip().lower()
    try:
        return f"{topo_mod.generation(m.group(1)).name}-{m.group(2)}"
    except TopologyError:
        return text.strip().lower()


def check_matches(spec: SliceSpec, topology: str | None, accelerator: str | None) -> None:
    """Raise SliceMismatchError when --topology / --accelerator contradict the slice found."""
    what = f"slice '{spec.name}' is {spec.accelerator_type or '?'} ({spec.topology or '?'})"
    if topology:
        want = topo_mod.parse_shape(topology)
        have = topo_mod.parse_shape(spec.topology) if spec.topology else None
        if have is not None and want != have:
            raise SliceMismatchError(
                f"--topology {topology} does not match: {what}",
                f"drop --topology, or pass --topology {spec.topology}",
            )
    if accelerator:
        if TYPE_RE.match(accelerator.strip().lower()):
            if spec.accelerator_type and _norm_type(accelerator) != _norm_type(spec.accelerator_type):
                raise SliceMismatchError(
                    f"--accelerator {accelerator} does not match: {what}",
                    f"drop --accelerator, or pass --accelerator {spec.accelerator_type}",
                )
        else:
            want_gen = topo_mod.generation(accelerator).name
            have_gen = generation_of(spec)
            if have_gen and want_gen != have_gen:
                raise SliceMismatchError(
                    f"--accelerator {accelerator} does not match: {what}, a {have_gen} slice",
                    f"drop --accelerator, or pass --accelerator {have_gen}",
                )


def readiness_problems(spec: SliceSpec) -> list[str]:
    """Why this slice is not fit to run on (empty when it is, or when the source cannot tell)."""
    problems = []
    if spec.state and spec.state != "READY":
        problems.append(f"state is {spec.state}, not READY")
    if spec.health and spec.health != "HEALTHY":
        desc = f" ({spec.health_description})" if spec.health_description else ""
        problems.append(f"health is {spec.health}{desc}")
    if spec.symptoms:
        problems.append("symptoms: " + "; ".join(spec.symptoms))
    return problems


def check_ready(spec: SliceSpec, force: bool) -> list[str]:
    """Raise SliceNotReadyError unless the slice is READY and HEALTHY with no symptoms, or `force`.

    Returns the problems that `force` let through, so the caller can warn about them.
    """
    problems = readiness_problems(spec)
    if problems and not force:
        raise SliceNotReadyError(
            f"slice '{spec.name}' is not ready: {'; '.join(problems)}",
            "wait and check again with `tpulaunch slice describe`, or pass --force to go on anyway",
        )
    return problems
