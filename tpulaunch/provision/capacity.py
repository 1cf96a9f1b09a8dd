"""Slices made and unmade: queued resources through the Cloud TPU API v2 (its write side).

A slice tpulaunch creates is a queued resource (QR) whose node spec names the slice, so it can be
asked what happened to it (WAITING_FOR_RESOURCES, PROVISIONING, ACTIVE, SUSPENDED after a
preemption, FAILED) and, because the QR keeps the spec it was created with, made again from
exactly that spec: a preempted spot slice is not revived by Google Cloud, it must be deleted and
created again.

`SliceOrder` is the request as data; `queued_resource_body()` is its REST JSON (pure, checked
against the REST reference in the tests); `create`, `delete`, `wait_active` and `recreate` do the
calls with the real client (`cloud_tpu.TpuApi`), each call bounded, each wait bounded and reporting
every change of state.
"""

from __future__ import annotations

import json
import re
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass

from tpulaunch.cloud_tpu import QR_GONE_BAD as GONE_BAD
from tpulaunch.cloud_tpu import TpuApi, api_timeout
from tpulaunch.errors import CapacityError, LaunchError, NameTakenError, NodeNotFoundError
from tpulaunch.plan import topology as topo_mod

# AcceleratorConfig.Type of the v2 API per generation (v7x is not offered through this API: GKE only).
API_CONFIG_TYPE = {"v2": "V2", "v3": "V3", "v4": "V4", "v5e": "V5LITE_POD", "v5p": "V5P", "v6e": "V6E"}
# The TPU VM software versions Google documents for each generation (`--runtime-version` overrides).
DEFAULT_RUNTIME = {"v2": "tpu-ubuntu2204-base", "v3": "tpu-ubuntu2204-base", "v4": "tpu-ubuntu2204-base",
                   "v5e": "v2-alpha-tpuv5-lite", "v5p": "v2-alpha-tpuv5", "v6e": "v2-alpha-tpuv6e"}
TIERS = ("on-demand", "spot", "reserved", "guaranteed")
WAITING = ("CREATING", "ACCEPTED", "WAITING_FOR_RESOURCES", "PROVISIONING")
Progress = Callable[[str], None]


@dataclass(frozen=True)
class SliceOrder:
    """What to create: one slice (`num_slices` 1, node `name`) or a multislice (nodes `name-0..`)."""

    name: str
    project: str
    zone: str
    accelerator_type: str  # v5p-64: the catalog's name (checked)
    topology: str | None = None  # given explicitly: sent as acceleratorConfig {type, topology}
    num_slices: int = 1
    tier: str = "on-demand"
    runtime_version: str | None = None  # None: the generation's default
    network: str | None = None
    subnetwork: str | None = None
    internal_ips: bool = False  # workers without external IPs (the network needs Private Google Access)

    @property
    def parent(self) -> str:
        return f"projects/{self.project}/locations/{self.zone}"

    @property
    def qr_name(self) -> str:
        return qr_path(self.project, self.zone, self.name)

    def node_names(self) -> list[str]:
        return [self.name] if self.num_slices == 1 else [f"{self.name}-{i}" for i in range(self.num_slices)]

    def to_dict(self) -> dict:
        return asdict(self)


def check_order(order: SliceOrder) -> SliceOrder:
    """The order with its accelerator checked against the catalog (one line, exit 2, if not: a flag's
    fault, found before the API is asked)."""
    if not re.fullmatch(r"[a-z]([-a-z0-9]{0,61}[a-z0-9])?", order.name):
        raise LaunchError(f"{order.name[:70]!r} is not a name the Cloud TPU API accepts",
                          "use lowercase letters, digits and dashes, starting with a letter (at most 63)")
    if order.tier not in TIERS:
        raise LaunchError(f"unknown tier '{order.tier}'", f"use one of {', '.join(TIERS)}")
    if not 1 <= order.num_slices <= 1024:
        raise LaunchError(f"--num-slices {order.num_slices} is not a number of slices", "use 1 to 1024")
    topo = topo_mod.resolve(topology=order.topology, accelerator=order.accelerator_type)
    gen = topo.generation.name
    if gen not in API_CONFIG_TYPE:
        raise LaunchError(f"{topo.accelerator_type} slices cannot be created through the Cloud TPU API v2"
                          " (TPU7x is offered through GKE only)", "create it with GKE / xpk")
    if order.num_slices > 1 and gen in ("v2", "v3"):
        raise LaunchError(f"{gen} slices do not form a multislice", "use --num-slices 1")
    return SliceOrder(**{**order.to_dict(), "accelerator_type": topo.accelerator_type,
                         "topology": order.topology and topo.topology,
                         "runtime_version": order.runtime_version or DEFAULT_RUNTIME[gen]})


def queued_resource_body(order: SliceOrder) -> dict:
    """The QueuedResource JSON for `order` (REST reference: projects.locations.queuedResources).

    The tier: spot `"spot": {}`, guaranteed `"guaranteed": {}`, reserved `reservationName`
    `.../reservations/-` (what `gcloud ... --reserved` sends); on-demand: none. The network config is
    always sent, with external IPs unless `internal_ips`, as gcloud sends it (`enableExternalIps = not
    args.internal_ips`): with it unset, a slice on a named network gets none, and `gcloud ... ssh`
    from outside the VPC cannot reach its workers."""
    gen = topo_mod.resolve(accelerator=order.accelerator_type).generation.name
    node: dict = {"runtimeVersion": order.runtime_version or DEFAULT_RUNTIME[gen]}
    if order.topology:
        node["acceleratorConfig"] = {"type": API_CONFIG_TYPE[gen], "topology": order.topology}
    else:
        node["acceleratorType"] = order.accelerator_type
    node["networkConfig"] = {**{k: v for k, v in (("network", order.network), ("subnetwork", order.subnetwork)) if v},
                             "enableExternalIps": not order.internal_ips}
    if order.tier == "spot":
        node["schedulingConfig"] = {"spot": True}
    spec: dict = {"parent": order.parent, "node": node}
    if order.num_slices > 1:
        spec["multisliceParams"] = {"nodeCount": order.num_slices, "nodeIdPrefix": order.name}
    else:
        spec["nodeId"] = order.name
    body: dict = {"tpu": {"nodeSpec": [spec]}}
    if order.tier == "spot":
        body["spot"] = {}
    elif order.tier == "guaranteed":
        body["guaranteed"] = {}
    elif order.tier == "reserved":
        body["reservationName"] = f"{order.parent}/reservations/-"
    return body


@dataclass(frozen=True)
class QrState:
    """A queued resource as the API says it is now."""

    name: str
    state: str  # WAITING_FOR_RESOURCES, PROVISIONING, ACTIVE, SUSPENDED, FAILED, ...
    initiator: str | None = None  # USER / SERVICE (for SUSPENDING / SUSPENDED)
    error: str | None = None  # FAILED: the service's reason
    body: dict | None = None  # what it was created with (for `recreate`)


def _state(qr) -> QrState:  # tpu_v2.QueuedResource
    from google.cloud import tpu_v2

    doc = json.loads(tpu_v2.QueuedResource.to_json(qr, use_integers_for_enums=False))
    st = doc.get("state") or {}
    err = ((st.get("failedData") or {}).get("error") or {}).get("message")
    body = {k: doc[k] for k in ("tpu", "spot", "guaranteed", "reservationName", "queueingPolicy") if k in doc}
    return QrState(doc.get("name", ""), st.get("state") or "STATE_UNSPECIFIED", st.get("stateInitiator"), err, body)


def qr_path(project: str, zone: str, name: str) -> str:
    return f"projects/{project}/locations/{zone}/queuedResources/{name}"


def get(project: str, zone: str, name: str, timeout: float | None = None) -> QrState | None:
    """The queued resource `name`, or None if there is none."""
    full = qr_path(project, zone, name)
    api = TpuApi(timeout=timeout)
    try:
        return api.run(lambda a: _state(a.get_queued_resource(full)))
    except NodeNotFoundError:
        return None


def list_states(project: str, zone: str, timeout: float | None = None) -> list[QrState]:
    api = TpuApi(timeout=timeout)
    return api.run(lambda a: [_state(q) for q in a.list_queued_resources(f"projects/{project}/locations/{zone}")])


def create(order: SliceOrder, body: dict | None = None, timeout: float | None = None) -> QrState:
    """Ask for the slice (the operation finishes once the request is accepted, not when the slice
    exists: `wait_active` waits for that)."""
    body = body or queued_resource_body(order)
    api = TpuApi(timeout=timeout)

    def op(a: TpuApi) -> QrState:
        lro = a.create_queued_resource(order.parent, order.name, body, str(uuid.uuid4()))
        return _state(a.operation_result(lro, order.qr_name, "tpu.queuedResources.create"))

    return api.run(op)


def delete(project: str, zone: str, name: str, timeout: float | None = None) -> bool:
    """Delete the queued resource and its nodes (force); False if there was none."""
    full = qr_path(project, zone, name)
    api = TpuApi(timeout=timeout)

    def op(a: TpuApi) -> bool:
        lro = a.delete_queued_resource(full, str(uuid.uuid4()), force=True)
        a.operation_result(lro, full, "tpu.queuedResources.delete")
        return True

    try:
        return api.run(op)
    except NodeNotFoundError:
        return False


def follow(project: str, zone: str, name: str, deadline_s: float, progress: Progress | None = None,
           first_poll_s: float = 0.5, max_poll_s: float = 5.0) -> QrState:
    """Poll the queued resource, reporting every change of state, until it is ACTIVE, SUSPENDED or
    FAILED, or `deadline_s` ran out: returns the state it was last in. Raises if it is gone."""
    say = progress or (lambda _m: None)
    end = time.monotonic() + deadline_s
    last, poll = None, first_poll_s
    while True:
        st = get(project, zone, name)
        if st is None:
            raise CapacityError(f"queued resource '{name}' does not exist (deleted meanwhile?)", "create it again")
        if st.state != last:
            say(f"queued resource {name}: {st.state}" + (f" ({st.error})" if st.error else ""))
            last = st.state
        left = end - time.monotonic()
        if st.state == "ACTIVE" or st.state in GONE_BAD or left <= 0:
            return st
        time.sleep(min(poll, left))
        poll = min(max_poll_s, poll * 1.5)


def not_active(name: str, st: QrState, deadline_s: float, flag: str) -> CapacityError:
    """Why a queued resource that `follow` returned is not ACTIVE, in one line; `flag` is the option
    that sets how long to wait. A zone without capacity keeps a request WAITING_FOR_RESOURCES (the
    service fails it only when its own validity window closes)."""
    if st.state in GONE_BAD:
        why = f": {st.error}" if st.error else ""
        return CapacityError(f"queued resource '{name}' is {st.state}{why}",
                             "delete it and create it again (`tpulaunch slice delete`, `slice create`)")
    hint = (f"the zone has no capacity for it now: wait longer ({flag}), or try another zone or tier"
            if st.state == "WAITING_FOR_RESOURCES" else f"wait longer ({flag})")
    return CapacityError(f"queued resource '{name}' is still {st.state} after {deadline_s:.0f} s", hint)


def wait_active(project: str, zone: str, name: str, deadline_s: float, progress: Progress | None = None,
                flag: str = "--wait-timeout") -> QrState:
    """Until the queued resource is ACTIVE; every change of state is reported. Raises on FAILED,
    SUSPENDED, a missing QR, or the deadline (saying the last state)."""
    st = follow(project, zone, name, deadline_s, progress)
    if st.state != "ACTIVE":
        raise not_active(name, st, deadline_s, flag)
    return st


def _left(end: float) -> float:
    """A forced delete's budget: what is left of the re-creation's (the service deletes the queued
    resource's nodes first, minutes where they are still there), never less than one API call's."""
    return max(api_timeout(), end - time.monotonic())


def recreate(project: str, zone: str, name: str, deadline_s: float, progress: Progress | None = None,
             retry_s: float | None = None, flag: str = "--preemption-wait") -> tuple[QrState, dict[str, float]]:
    """Delete the queued resource and create it again from the spec it was created with, then
    wait until ACTIVE, all within `deadline_s` (`flag` sets it). A refusal for capacity (quota) and a
    request that turned FAILED (the service gave up on it: its validity window closed) are asked
    again until then (every 10 s, or a sixth of a shorter deadline, so it is asked several times); a
    name in use is not. In a stockout the request waits (WAITING_FOR_RESOURCES) to the deadline.
    Returns the new state and how long each step took."""
    say = progress or (lambda _m: None)
    retry_s = retry_s if retry_s is not None else min(10.0, max(1.0, deadline_s / 6))
    end = time.monotonic() + deadline_s
    old = get(project, zone, name)
    if old is None or not old.body:
        raise CapacityError(f"queued resource '{name}' is gone and nothing records how it was created",
                            "create it again with `tpulaunch slice create`")
    t = time.monotonic()
    say(f"queued resource {name} is {old.state}: deleting it")
    delete(project, zone, name, timeout=_left(end))
    took = {"delete_s": time.monotonic() - t, "create_s": 0.0, "provision_s": 0.0}
    order = SliceOrder(name=name, project=project, zone=zone, accelerator_type="")
    while True:
        t = time.monotonic()
        try:
            say(f"creating queued resource {name} again (the spec it was created with)")
            create(order, body=old.body)
        except NameTakenError:
            raise
        except CapacityError as e:
            if time.monotonic() + retry_s >= end:
                raise
            say(f"{e.message}; retrying in {retry_s:.0f} s")
            time.sleep(retry_s)
            took["create_s"] += time.monotonic() - t
            continue
        took["create_s"] += time.monotonic() - t
        t = time.monotonic()
        st = follow(project, zone, name, max(1.0, end - time.monotonic()), say)
        if st.state == "ACTIVE":
            took["provision_s"] += time.monotonic() - t
            return st, took
        if st.state != "FAILED" or time.monotonic() + retry_s >= end:
            raise not_active(name, st, deadline_s, flag)
        say(f"{not_active(name, st, deadline_s, flag).message}; deleting and asking again in {retry_s:.0f} s")
        time.sleep(retry_s)
        delete(project, zone, name, timeout=_left(end))
        took["provision_s"] += time.monotonic() - t
