"""Cloud TPU API nodes and queued resources -> `SliceSpec` (discovery through `tpulaunch.cloud_tpu`).

What a node says (its accelerator type or config, its workers' endpoints, its state and health) is
read into the slice the plan is made for; a queued resource's nodes are its slices, in order.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import re
import warnings
from typing import Any

from tpulaunch.cloud_tpu import QR_GONE_BAD, TpuApi, path_part
from tpulaunch.errors import DiscoveryError, NodeNotFoundError, SliceNotReadyError, TopologyError, TpulaunchError
from tpulaunch.plan import topology as topo_mod
from tpulaunch.plan.slicespec import SliceSpec, WorkerEndpoint

# AcceleratorConfig.Type names -> accelerator-type prefix (generation name for the catalog).
_CONFIG_TYPE_PREFIX = {"V5LITE_POD": "v5litepod"}


# -- Node -> SliceSpec -------------------------------------------------------------------------


def _enum_name(value: Any, raw: Any) -> str | None:
    """Name of an enum field, keeping values the installed client does not know as strings."""
    if isinstance(value, enum.Enum):
        if value.value != 0:
            return value.name
        # Unspecified after parsing: the server may have sent a name this client does not know.
        if isinstance(raw, str) and raw and not raw.endswith("_UNSPECIFIED"):
            return raw
        return None
    if isinstance(value, int) and value != 0:
        return raw if isinstance(raw, str) and raw else str(value)
    return None


def type_from_config(config_type: str, shape: str) -> str:
    """`V4` + `2x2x4` -> `v4-32`, `V7X` + `2x2x2` -> `tpu7x-16`; unknown generations stay strings."""
    if config_type.isdigit():
        return f"unknown-type-{config_type}"  # an enum number nobody here knows: keep it visible
    prefix = _CONFIG_TYPE_PREFIX.get(config_type.upper(), config_type.lower())
    try:
        gen = topo_mod.generation(prefix)
        chips = math.prod(topo_mod.parse_shape(shape)) if shape else 0
    except TopologyError:
        return prefix
    return gen.accelerator_type(chips) if chips else gen.type_prefix


def node_to_spec(node: Any, raw: dict | None = None, provenance: dict[str, str] | None = None) -> SliceSpec:
    """Normalize a `tpu_v2.Node` into a SliceSpec (network endpoints keep their order: worker order)."""
    raw = raw or {}
    prov = dict(provenance or {})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        full = node.name
        cfg = node.accelerator_config
        raw_cfg = raw.get("acceleratorConfig") or {}
        shape = cfg.topology or ""
        config_type = _enum_name(cfg.type_, raw_cfg.get("type")) if "accelerator_config" in node else None
        if config_type is None and isinstance(raw_cfg.get("type"), str) and raw_cfg["type"]:
            config_type = raw_cfg["type"]
        acc = node.accelerator_type or ""
        if not acc and config_type:
            acc = type_from_config(config_type, shape)
            prov["accelerator_type"] = f"acceleratorConfig.type {config_type} x {shape or '?'}"
        if not shape and acc:
            try:
                shape = topo_mod.parse_accelerator_type(acc).topology
                prov["topology"] = f"catalog default shape for {acc}"
            except TopologyError:
                shape = ""
        state = _enum_name(node.state, raw.get("state"))
        health = _enum_name(node.health, raw.get("health"))
        raw_symptoms = raw.get("symptoms") or []
        symptoms = []
        for i, s in enumerate(node.symptoms):
            raw_s = raw_symptoms[i] if i < len(raw_symptoms) and isinstance(raw_symptoms[i], dict) else {}
            kind = _enum_name(s.symptom_type, raw_s.get("symptomType")) or "SYMPTOM"
            where = f" on worker {s.worker_id}" if s.worker_id else ""
            symptoms.append(f"{kind}{where}: {s.details}" if s.details else f"{kind}{where}")
        workers = tuple(
            WorkerEndpoint(
                worker_id=i,
                ip=e.ip_address,
                external_ip=(e.access_config.external_ip or None) if "access_config" in e else None,
            )
            for i, e in enumerate(node.network_endpoints)
        )
        sched = node.scheduling_config
        return SliceSpec(
            name=full.rsplit("/", 1)[-1],
            accelerator_type=acc,
            topology=shape,
            source="tpu-api",
            zone=path_part(full, "locations"),
            project=path_part(full, "projects"),
            state=state,
            health=health,
            health_description=node.health_description or None,
            spot=bool(sched.spot),
            preemptible=bool(sched.preemptible),
            runtime_version=node.runtime_version or None,
            workers=workers,
            symptoms=tuple(symptoms),
            queued_resource=node.queued_resource or None,
            multislice_node=bool(node.multislice_node),
            provenance=prov,
        )


# -- operations ---------------------------------------------------------------------------------


def node_path(project: str, zone: str, name: str) -> str:
    return f"projects/{project}/locations/{zone}/nodes/{name}"


def get_node_spec(
    project: str, zone: str, name: str, *, timeout: float | None = None, endpoint: str | None = None,
    provenance: dict[str, str] | None = None,
) -> SliceSpec:
    """Describe one node. A 404 lists the nodes that do exist in that zone, so typos are obvious."""
    api = TpuApi(endpoint=endpoint, timeout=timeout)
    full = node_path(project, zone, name)

    def op(api: TpuApi) -> SliceSpec:
        try:
            node = api.get_node(full)
        except NodeNotFoundError:
            raise _not_found(api, project, zone, name, provenance or {}) from None
        return node_to_spec(node, api.raw_nodes.get(node.name), provenance)

    return api.run(op)


def _not_found(api: TpuApi, project: str, zone: str, name: str, prov: dict[str, str]) -> NodeNotFoundError:
    where = f"zone {zone} of project {project}"
    origin = ", ".join(f"{k} from {prov[k]}" for k in ("project", "zone") if k in prov)
    check = f"check --zone/--project ({origin})" if origin else "check --zone/--project"
    try:
        existing = [n.name.rsplit("/", 1)[-1] for n in api.list_nodes(f"projects/{project}/locations/{zone}")]
    except TpulaunchError as e:
        return NodeNotFoundError(
            f"TPU node '{name}' not found in {where} (listing the zone failed too: {e.message})", check
        )
    if not existing:
        return NodeNotFoundError(f"TPU node '{name}' not found: there are no TPU nodes in {where}", check)
    shown = ", ".join(existing[:20]) + (f", ... ({len(existing)} in all)" if len(existing) > 20 else "")
    return NodeNotFoundError(f"TPU node '{name}' not found in {where}; nodes there: {shown}", check)


def list_node_specs(
    project: str, zone: str, *, timeout: float | None = None, endpoint: str | None = None,
    page_size: int | None = None, provenance: dict[str, str] | None = None,
) -> list[SliceSpec]:
    """All nodes of a zone (`-` for every zone), following `nextPageToken` across pages."""
    api = TpuApi(endpoint=endpoint, timeout=timeout)
    parent = f"projects/{project}/locations/{zone}"

    def op(api: TpuApi) -> list[SliceSpec]:
        return [node_to_spec(n, api.raw_nodes.get(n.name), provenance) for n in api.list_nodes(parent, page_size)]

    return api.run(op)


def queued_resource_specs(
    project: str, zone: str, name: str, *, timeout: float | None = None, endpoint: str | None = None,
    provenance: dict[str, str] | None = None,
) -> list[SliceSpec]:
    """The slices of a queued resource, one SliceSpec per node, `slice_index` in multislice order."""
    api = TpuApi(endpoint=endpoint, timeout=timeout)
    full = f"projects/{project}/locations/{zone}/queuedResources/{name}"

    def op(api: TpuApi) -> list[SliceSpec]:
        try:
            qr = api.get_queued_resource(full)
        except NodeNotFoundError:
            raise NodeNotFoundError(
                f"queued resource '{name}' not found in zone {zone} of project {project}",
                "check the name and --zone/--project (gcloud compute tpus queued-resources list)",
            ) from None
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            state = _enum_name(qr.state.state, None) or "STATE_UNSPECIFIED"
            node_names: list[str] = []
            for ns in qr.tpu.node_spec:
                parent = ns.parent or f"projects/{project}/locations/{zone}"
                count = ns.multislice_params.node_count if "multislice_params" in ns else 0
                if count:
                    prefix = ns.multislice_params.node_id_prefix or name
                    node_names += [f"{parent}/nodes/{prefix}-{i}" for i in range(count)]
                elif ns.node_id:
                    node_names.append(f"{parent}/nodes/{ns.node_id}")
        if not node_names:
            raise DiscoveryError(f"queued resource '{name}' names no TPU nodes (state {state})")
        prov = dict(provenance or {}, queued_resource_state=state)
        specs = []
        for i, node_name in enumerate(node_names):
            try:
                node = api.get_node(node_name)
            except NodeNotFoundError:
                node_id = node_name.rsplit('/', 1)[-1]
                if state in QR_GONE_BAD:
                    raise SliceNotReadyError(
                        f"queued resource '{name}' is {state}: its node {node_id} is gone",
                        f"delete it and create it again (tpulaunch slice delete {name}, then slice create), or let"
                        " a run do it (run --recreate)",
                    ) from None
                if state != "ACTIVE":
                    raise SliceNotReadyError(
                        f"queued resource '{name}' is {state}: its node {node_id} does not exist yet",
                        "wait until it is ACTIVE (gcloud compute tpus queued-resources describe"
                        f" {name} --zone {zone})",
                    ) from None
                raise NodeNotFoundError(
                    f"queued resource '{name}' is ACTIVE but its node {node_name.rsplit('/', 1)[-1]} was not found"
                ) from None
            spec = node_to_spec(node, api.raw_nodes.get(node.name), prov)
            specs.append(
                dataclasses.replace(
                    spec, slice_index=i, queued_resource=full,
                    multislice_node=spec.multislice_node or len(node_names) > 1,
                )
            )
        return specs

    return api.run(op)


_FULL_NODE_RE = re.compile(r"^projects/([^/]+)/locations/([^/]+)/nodes/([^/]+)$")


def split_node_path(name: str) -> tuple[str | None, str | None, str]:
    """`projects/P/locations/Z/nodes/N` -> (P, Z, N); a bare `N` -> (None, None, N)."""
    m = _FULL_NODE_RE.match(name.strip())
    if m:
        return m.group(1), m.group(2), m.group(3)
    return None, None, name.strip()
