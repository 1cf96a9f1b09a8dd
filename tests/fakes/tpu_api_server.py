"""A fake Cloud TPU API v2 over HTTP, for the real `google.cloud.tpu_v2.TpuClient(transport="rest")`.

It serves the real REST paths and JSON (camelCase fields; enums as numbers when the client asks for
`enum-encoding=int`, as the real service answers the installed client, or as names with
`int_enums=False`), pages with
`pageSize`/`pageToken`/`nextPageToken`, and answers errors in Google's JSON error format. Anything
that is not a real path is rejected (and recorded in `rejected`, so tests can assert there was none).

    with FakeTpuApi(standard_nodes(), standard_queued_resources()) as api:
        env["TPULAUNCH_TPU_API_ENDPOINT"] = api.url

Queued resources are a real write side: `POST .../queuedResources?queuedResourceId=` (validated as
the service validates: parent, runtime version, acceleratorType xor acceleratorConfig, nodeId xor
multisliceParams, one tier), `DELETE ...?force=true`, and long-running operations at
`.../operations/*` whose finished form is exactly what the client's strict parser accepts. States
move with the clock, as the documented lifecycle goes: WAITING_FOR_RESOURCES (`wait_s`) ->
PROVISIONING (`provision_s`) -> ACTIVE, when the nodes appear (fresh 10.x IPs, `queuedResource`,
`multisliceNode`, spot) and are written into the fake gcloud's slices file (`gcloud_slices`) so
`gcloud ... ssh` reaches them. `set_capacity(stockout=True)` keeps every request that has not
started provisioning in WAITING_FOR_RESOURCES, as the service does while a zone has no capacity: a
request turns FAILED only when its own window closes (`queueingPolicy.validUntilDuration`, which
`gcloud ... --valid-until-duration` sets), with the service's expiry reason;
`set_capacity(quota="...")` refuses creates with 429. `preempt(node)` (or `POST /_fake/preempt`
{"node": N}, the test-only control endpoint) does what Google Cloud does to a spot slice: the node
goes PREEMPTED, the fake workers' processes of that node (everything the fake gcloud started for
it) are killed and their VM disks (/tmp copies) wiped; after `suspend_s` the node is gone and the
queued resource is SUSPENDED (initiator SERVICE). Nothing comes back by itself.

Modes: "ok"; "forbidden" (403 PERMISSION_DENIED naming the permission, for everything or only
the permissions in `denied`); "disabled" (403 SERVICE_DISABLED); "slow" (sleeps `slow_seconds`
before answering, longer than any client timeout in the tests); "trickle" (sends the headers at
once, then the body one byte every 0.5 s, so no single socket read ever times out).
"""

from __future__ import annotations

import copy
import glob
import json
import os
import re
import shutil
import signal
import threading
import time
import zlib
from pathlib import Path
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Iterable
from urllib.parse import parse_qs, urlsplit

DEFAULT_PROJECT = "p"

# Enum numbers of google.cloud.tpu.v2 (cloud_tpu.proto), for int_enums mode.
_STATE = {
    "STATE_UNSPECIFIED": 0, "CREATING": 1, "READY": 2, "RESTARTING": 3, "REIMAGING": 4, "DELETING": 5,
    "REPAIRING": 6, "STOPPED": 8, "STOPPING": 9, "STARTING": 10, "PREEMPTED": 11, "TERMINATED": 12,
    "HIDING": 13, "HIDDEN": 14, "UNHIDING": 15, "UNKNOWN": 16,
}
_HEALTH = {"HEALTH_UNSPECIFIED": 0, "HEALTHY": 1, "TIMEOUT": 3, "UNHEALTHY_TENSORFLOW": 4, "UNHEALTHY_MAINTENANCE": 5}
_TYPE = {"TYPE_UNSPECIFIED": 0, "V2": 2, "V3": 4, "V4": 7, "V5LITE_POD": 9, "V5P": 10, "V6E": 11}
_SYMPTOM = {
    "SYMPTOM_TYPE_UNSPECIFIED": 0, "LOW_MEMORY": 1, "OUT_OF_MEMORY": 2, "EXECUTE_TIMED_OUT": 3,
    "MESH_BUILD_FAIL": 4, "HBM_OUT_OF_MEMORY": 5, "PROJECT_ABUSE": 6,
}
_QR_STATE = {
    "STATE_UNSPECIFIED": 0, "CREATING": 1, "ACCEPTED": 2, "PROVISIONING": 3, "FAILED": 4, "DELETING": 5,
    "ACTIVE": 6, "SUSPENDING": 7, "SUSPENDED": 8, "WAITING_FOR_RESOURCES": 9,
}

_SEG = r"([^/:?]+)"
_ROUTES = [
    ("get_node", re.compile(rf"^/v2/projects/{_SEG}/locations/{_SEG}/nodes/{_SEG}$"), "tpu.nodes.get"),
    ("list_nodes", re.compile(rf"^/v2/projects/{_SEG}/locations/{_SEG}/nodes$"), "tpu.nodes.list"),
    ("get_qr", re.compile(rf"^/v2/projects/{_SEG}/locations/{_SEG}/queuedResources/{_SEG}$"), "tpu.queuedResources.get"),
    ("list_qrs", re.compile(rf"^/v2/projects/{_SEG}/locations/{_SEG}/queuedResources$"), "tpu.queuedResources.list"),
    ("get_op", re.compile(rf"^/v2/projects/{_SEG}/locations/{_SEG}/operations/{_SEG}$"), "tpu.operations.get"),
]
# Write routes: (route, method) -> permission. A path of a read route with another method is refused.
_WRITES = {("list_qrs", "POST"): ("create_qr", "tpu.queuedResources.create"),
           ("get_qr", "DELETE"): ("delete_qr", "tpu.queuedResources.delete")}
_CONFIG_TYPES = {"V2": "v2", "V3": "v3", "V4": "v4", "V5LITE_POD": "v5litepod", "V5P": "v5p", "V6E": "v6e"}
# Per accelerator family: (accelerator-type number counts cores or chips, cores per chip, chips per host).
_FAMILY = {"v2": (2, 4), "v3": (2, 4), "v4": (2, 4), "v5p": (2, 4), "v5litepod": (1, 4), "v6e": (1, 4)}
# Default topologies the service picks for an acceleratorType (the ones the tests ask for).
_TYPE_TOPOLOGY = {"v4-8": "2x2x1", "v4-16": "2x2x2", "v4-32": "2x2x4", "v5p-8": "2x2x1", "v5p-16": "2x2x2",
                  "v5litepod-4": "2x2", "v5litepod-8": "2x4", "v5litepod-16": "4x4", "v6e-4": "2x2", "v6e-8": "2x4",
                  "v6e-16": "4x4", "v2-8": "2x2", "v3-8": "2x2"}
RUNTIMES = {"tpu-ubuntu2204-base", "tpu-vm-base", "v2-alpha-tpuv5", "v2-alpha-tpuv5-lite", "v2-alpha-tpuv6e",
            "tpu-vm-tf-2.16.1-pjrt", "v2-alpha-tpu7-ubuntu2404"}
EXPIRED = "The queued resource request could not be fulfilled before its valid until time"
_STATUS = {400: "INVALID_ARGUMENT", 409: "ALREADY_EXISTS", 429: "RESOURCE_EXHAUSTED", 403: "PERMISSION_DENIED", 404: "NOT_FOUND", 405: "METHOD_NOT_ALLOWED", 501: "UNIMPLEMENTED"}


# -- fixtures ------------------------------------------------------------------------------------


def make_node(
    zone: str,
    node_id: str,
    *,
    project: str = DEFAULT_PROJECT,
    accelerator_type: str | None = None,
    accelerator_config: dict | None = None,
    ips: Iterable[str] = (),
    external_ips: Iterable[str | None] | None = None,
    state: str | int = "READY",
    health: str | int | None = "HEALTHY",
    health_description: str | None = None,
    runtime_version: str = "tpu-ubuntu2204-base",
    spot: bool = False,
    preemptible: bool = False,
    symptoms: Iterable[dict] = (),
    queued_resource: str | None = None,
    multislice_node: bool = False,
) -> dict:
    """A Node as the v2 REST API returns it (camelCase JSON)."""
    ips = list(ips)
    externals = list(external_ips) if external_ips is not None else [None] * len(ips)
    endpoints = []
    for ip, ext in zip(ips, externals):
        ep: dict[str, Any] = {"ipAddress": ip, "port": 8470}
        if ext:
            ep["accessConfig"] = {"externalIp": ext}
        endpoints.append(ep)
    node: dict[str, Any] = {
        "name": f"projects/{project}/locations/{zone}/nodes/{node_id}",
        "description": f"fixture {node_id}",
        "state": state,
        "runtimeVersion": runtime_version,
        "networkConfig": {
            "network": f"projects/{project}/global/networks/default",
            "subnetwork": f"projects/{project}/regions/{zone.rsplit('-', 1)[0]}/subnetworks/default",
            "enableExternalIps": any(externals),
        },
        "serviceAccount": {"email": "1234-compute@developer.gserviceaccount.com", "scope": ["https://www.googleapis.com/auth/cloud-platform"]},
        "createTime": "2025-06-01T12:00:00.000000Z",
        "schedulingConfig": {k: v for k, v in (("spot", spot), ("preemptible", preemptible)) if v},
        "networkEndpoints": endpoints,
        "id": str(zlib.crc32(f"{project}/{zone}/{node_id}".encode())),
        "apiVersion": "V2",
        "shieldedInstanceConfig": {},
        "labels": {"owner": "tests"},
    }
    if accelerator_type:
        node["acceleratorType"] = accelerator_type
    if accelerator_config:
        node["acceleratorConfig"] = accelerator_config
    if health is not None:
        node["health"] = health
    if health_description:
        node["healthDescription"] = health_description
    if symptoms:
        node["symptoms"] = list(symptoms)
    if queued_resource:
        node["queuedResource"] = queued_resource
    if multislice_node:
        node["multisliceNode"] = True
    return node


def _ips(prefix: str, n: int) -> list[str]:
    return [f"{prefix}.{i + 2}" for i in range(n)]


def standard_nodes(project: str = DEFAULT_PROJECT) -> list[dict]:
    """Realistic nodes: every generation, odd enums, unhealthy, not ready, spot, and a busy zone."""
    c2 = "us-central2-b"
    nodes = [
        # v4-32 = 2x2x4: 4 VMs, both acceleratorType and acceleratorConfig, external IPs.
        make_node(c2, "my-v4", project=project, accelerator_type="v4-32",
                  accelerator_config={"type": "V4", "topology": "2x2x4"},
                  ips=_ips("10.130.0", 4), external_ips=[f"34.27.1.{i}" for i in range(10, 14)]),
        make_node(c2, "v4-creating", project=project, accelerator_type="v4-8",
                  accelerator_config={"type": "V4", "topology": "2x2x1"}, state="CREATING", health=None,
                  ips=[]),
        make_node(c2, "v4-sick", project=project, accelerator_type="v4-16",
                  accelerator_config={"type": "V4", "topology": "2x2x2"}, health="UNHEALTHY_TENSORFLOW",
                  health_description="The TPU runtime on worker 1 is not responding", ips=_ips("10.130.1", 2),
                  symptoms=[{"createTime": "2025-06-01T13:00:00Z", "symptomType": "HBM_OUT_OF_MEMORY",
                             "details": "HBM usage at 100% on chip 3", "workerId": "1"}]),
        # v5e via acceleratorType only (no acceleratorConfig): topology must come from the catalog.
        make_node("us-west4-a", "my-v5e", project=project, accelerator_type="v5litepod-16",
                  runtime_version="v2-alpha-tpuv5-lite", ips=_ips("10.164.0", 4)),
        make_node("us-west4-a", "spot-v5e", project=project, accelerator_type="v5litepod-8",
                  runtime_version="v2-alpha-tpuv5-lite", ips=["10.164.9.2"], spot=True),
        # v5p via acceleratorConfig only.
        make_node("us-east5-a", "my-v5p", project=project,
                  accelerator_config={"type": "V5P", "topology": "2x2x4"},
                  runtime_version="v2-alpha-tpuv5", ips=_ips("10.202.0", 4)),
        make_node("europe-west4-a", "my-v6e", project=project, accelerator_type="v6e-16",
                  accelerator_config={"type": "V6E", "topology": "4x4"},
                  runtime_version="v2-alpha-tpuv6e", ips=_ips("10.164.2", 4)),
        # Ironwood: the installed client has no V7X enum value.
        make_node("us-central1-c", "my-v7x", project=project,
                  accelerator_config={"type": "V7X", "topology": "2x2x2"},
                  runtime_version="v2-alpha-tpu7-ubuntu2404", ips=_ips("10.128.7", 2)),
        make_node("us-central1-c", "v7x-int", project=project, accelerator_type="tpu7x-16",
                  accelerator_config={"type": 12, "topology": "2x2x2"},
                  runtime_version="v2-alpha-tpu7-ubuntu2404", ips=_ips("10.128.8", 2)),
        make_node("us-central1-c", "my-tpu7x", project=project, accelerator_type="tpu7x-16",
                  runtime_version="v2-alpha-tpu7-ubuntu2404", ips=_ips("10.128.9", 2)),
        # Only an enum number nobody knows: must stay visible, not crash.
        make_node("us-central1-c", "v7x-intonly", project=project,
                  accelerator_config={"type": 12, "topology": "2x2x2"},
                  runtime_version="v2-alpha-tpu7-ubuntu2404", ips=_ips("10.128.10", 2)),
    ]
    # Multislice: queued resource "ms-qr" made two v4-16 slices, ms-0 and ms-1.
    for i in range(2):
        nodes.append(
            make_node(c2, f"ms-{i}", project=project, accelerator_type="v4-16",
                      accelerator_config={"type": "V4", "topology": "2x2x2"}, ips=_ips(f"10.130.{10 + i}", 2),
                      queued_resource=f"projects/{project}/locations/{c2}/queuedResources/ms-qr",
                      multislice_node=True, spot=True)
        )
    # A busy zone: more nodes than one page.
    for i in range(7):
        nodes.append(
            make_node("us-east1-d", f"busy-{i}", project=project, accelerator_type="v6e-8",
                      runtime_version="v2-alpha-tpuv6e", ips=[f"10.142.0.{i + 2}"])
        )
    return nodes


def standard_queued_resources(project: str = DEFAULT_PROJECT) -> list[dict]:
    c2 = "us-central2-b"
    parent = f"projects/{project}/locations/{c2}"
    return [
        {
            "name": f"{parent}/queuedResources/ms-qr",
            "createTime": "2025-06-01T11:00:00Z",
            "tpu": {"nodeSpec": [{
                "parent": parent,
                "multisliceParams": {"nodeCount": 2, "nodeIdPrefix": "ms"},
                "node": {"acceleratorType": "v4-16", "runtimeVersion": "tpu-ubuntu2204-base"},
            }]},
            "spot": {},
            "state": {"state": "ACTIVE", "stateInitiator": "SERVICE"},
        },
        {
            "name": f"{parent}/queuedResources/waiting-qr",
            "createTime": "2025-06-01T11:30:00Z",
            "tpu": {"nodeSpec": [{
                "parent": parent, "nodeId": "waiting-node",
                "node": {"acceleratorType": "v4-32", "runtimeVersion": "tpu-ubuntu2204-base"},
            }]},
            "state": {"state": "WAITING_FOR_RESOURCES", "waitingForResourcesData": {}},
        },
    ]


# -- server --------------------------------------------------------------------------------------


class FakeTpuApi:
    """The fake service. `url` is what to put in TPULAUNCH_TPU_API_ENDPOINT."""

    def __init__(
        self,
        nodes: Iterable[dict] = (),
        queued_resources: Iterable[dict] = (),
        *,
        mode: str = "ok",
        denied: Iterable[str] = (),
        slow_seconds: float = 60.0,
        default_page_size: int | None = None,
        max_page_size: int = 1000,
        int_enums: bool = True,
        op_delay_s: float = 0.0,
        wait_s: float = 0.5,
        provision_s: float = 0.5,
        suspend_s: float = 1.0,
        delete_s: float = 0.0,
        gcloud_slices: str | None = None,
    ) -> None:
        self.nodes: dict[str, dict] = {n["name"]: n for n in nodes}
        self.queued_resources: dict[str, dict] = {q["name"]: q for q in queued_resources}
        self.mode = mode
        self.denied = set(denied)
        self.slow_seconds = slow_seconds
        self.default_page_size = default_page_size
        self.max_page_size = max_page_size
        self.int_enums = int_enums
        self.requests: list[dict] = []  # every request: method, path, query, authorization
        self.rejected: list[str] = []  # requests that were not real Cloud TPU API v2 calls
        self.op_delay_s, self.wait_s, self.provision_s = op_delay_s, wait_s, provision_s
        self.suspend_s = suspend_s
        # a forced delete of a queued resource that still has nodes deletes them first: its operation
        # ends this much later (real ones take minutes; tests keep it short and the client's budget shorter)
        self.delete_s = delete_s
        self.gcloud_slices = gcloud_slices  # the fake gcloud's FAKE_GCLOUD_SLICES file, kept in step
        self.stockout = False
        self.quota: str | None = None  # a quota name: creates are refused with 429
        self.operations: dict[str, dict] = {}
        self.events: list[str] = []  # what happened to capacity, in order ("preempt my-slice", ...)
        self._timeline: dict[str, dict] = {}  # QR name -> when its states change (monotonic times)
        self._created: dict[str, float] = {}  # QR name -> when it was asked for (monotonic)
        self._lock = threading.RLock()
        self._ops = 0
        self._subnets = 200
        self._stop = threading.Event()
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    # -- lifecycle
    def start(self) -> "FakeTpuApi":
        fake = self

        class Handler(_Handler):
            api = fake

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, args=(0.05,), name="fake-tpu-api", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop serving, and end the VMs that are left (a VM's init outlives its processes, as a VM does)."""
        self._stop.set()
        if self._server:
            self._server.shutdown()
            self._server.server_close()
        with self._lock:
            names = list(self.nodes)
        for pid in _vm_processes(names):
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass

    def __enter__(self) -> "FakeTpuApi":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def port(self) -> int:
        assert self._server is not None, "start() first"
        return self._server.server_address[1]

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def calls(self, route: str) -> list[dict]:
        return [r for r in self.requests if r.get("route") == route]

    # -- behaviour
    def handle(self, method: str, raw_path: str, headers: Any, body: bytes = b"") -> tuple[int, dict]:
        with self._lock:
            return self._handle(method, raw_path, headers, body)

    def _handle(self, method: str, raw_path: str, headers: Any, body: bytes) -> tuple[int, dict]:
        parts = urlsplit(raw_path)
        if parts.path.startswith("/_fake/") and method == "POST":
            return self._control(parts.path, json.loads(body or b"{}"))
        self._advance()
        query = parse_qs(parts.query, keep_blank_values=True)
        for alt in query.get("$alt", []):  # `$alt=json;enum-encoding=int`
            for item in alt.split(";")[1:]:
                key, _, value = item.partition("=")
                query.setdefault(key, []).append(value)
        record = {"method": method, "path": parts.path, "query": query,
                  "authorization": headers.get("Authorization"), "body": json.loads(body) if body else None}
        self.requests.append(record)
        for route, pattern, permission in _ROUTES:
            m = pattern.match(parts.path)
            if m:
                break
        else:
            self.rejected.append(f"{method} {raw_path}")
            return _error(404, f"fake Cloud TPU API: {parts.path} is not a Cloud TPU API v2 path")
        if method != "GET":
            if (route, method) not in _WRITES:
                self.rejected.append(f"{method} {raw_path}")
                return _error(501, f"fake Cloud TPU API: {method} {parts.path} is not implemented")
            route, permission = _WRITES[(route, method)]
        record["route"] = route
        if self.mode == "slow":
            self._stop.wait(self.slow_seconds)
        project, zone = m.group(1), m.group(2)
        if self.mode == "disabled":
            return _error(403, f"Cloud TPU API has not been used in project {project} before or it is disabled.",
                          reason="SERVICE_DISABLED", metadata={"service": "tpu.googleapis.com", "consumer": f"projects/{project}"})
        if self.mode == "forbidden" or permission in self.denied:
            resource = parts.path.removeprefix("/v2/")
            return _error(403, f"Permission '{permission}' denied on '{resource}'",
                          reason="IAM_PERMISSION_DENIED", metadata={"permission": permission, "resource": resource})
        enc_int = self.int_enums and "int" in query.get("enum-encoding", [])
        if route == "get_node":
            name = parts.path.removeprefix("/v2/")
            node = self.nodes.get(name)
            if node is None:
                return _error(404, f"Resource '{name}' was not found")
            return 200, self._out(node, enc_int)
        if route == "list_nodes":
            return self._list(f"projects/{project}/locations/{zone}", zone, query, enc_int)
        if route == "create_qr":
            return self._create_qr(f"projects/{project}/locations/{zone}", query, record["body"] or {})
        if route == "delete_qr":
            return self._delete_qr(parts.path.removeprefix("/v2/"), query)
        if route == "get_op":
            op = self.operations.get(parts.path.removeprefix("/v2/"))
            if op is None:
                return _error(404, f"Resource '{parts.path.removeprefix('/v2/')}' was not found")
            return 200, self._op_out(op)
        if route == "get_qr":
            name = parts.path.removeprefix("/v2/")
            qr = self.queued_resources.get(name)
            if qr is None:
                return _error(404, f"Resource '{name}' was not found")
            return 200, self._out_qr(qr, enc_int)
        qrs = [self._out_qr(q, enc_int) for n, q in sorted(self.queued_resources.items())
               if n.startswith(f"projects/{project}/locations/{zone}/")]
        return 200, {"queuedResources": qrs} if qrs else {}

    # -- capacity: what tests do to the fake (in process, or through the control endpoint)
    def preempt(self, node_id: str, shutdown_s: float = 0.0) -> None:
        """Google Cloud preempts a spot slice: the node goes PREEMPTED, its VMs stop at once (their
        processes killed, their disks gone); a queued resource goes SUSPENDING, then SUSPENDED with
        its nodes deleted. A plain spot node stays PREEMPTED until someone deletes it. With
        `shutdown_s`, the VMs shut down as a soft-off does, in no order that spares the launcher:
        the scripts (processes with no child) end first, the rest (agents, raylets) `shutdown_s` later."""
        with self._lock:
            self._advance()
            name = self._node_name(node_id)
            node = self.nodes[name]
            node["state"] = "PREEMPTED"
            node.pop("health", None)
            self.events.append(f"preempt {node_id}")
            self._set_slice_state(name, "PREEMPTED")
            kill_workers(name, shutdown_s)
            qr = self.queued_resources.get(node.get("queuedResource") or "")
            if qr is not None and qr["state"]["state"] == "ACTIVE":
                qr["state"] = {"state": "SUSPENDING", "stateInitiator": "SERVICE"}
                self._timeline[qr["name"]] = {"suspended_at": time.monotonic() + self.suspend_s}

    def set_capacity(self, *, stockout: bool | None = None, quota: str | None = "") -> None:
        """`stockout`: requests not yet provisioning wait (WAITING_FOR_RESOURCES) until it is turned
        off, which lets them through. `quota`: a quota name that refuses creates."""
        with self._lock:
            self._advance()
            if quota != "":
                self.quota = quota
            if stockout is not None and stockout != self.stockout:
                self.stockout = stockout
                self.events.append(f"stockout {stockout}")
                for name, qr in self.queued_resources.items():
                    if qr["state"]["state"] == "WAITING_FOR_RESOURCES":
                        self._timeline[name] = self._waiting_timeline(name)

    def _control(self, path: str, doc: dict) -> tuple[int, dict]:
        if path == "/_fake/preempt":
            try:
                self.preempt(doc["node"], float(doc.get("shutdown_s") or 0.0))
            except KeyError:
                return _error(404, f"fake: no node {doc.get('node')!r}")
            return 200, {}
        if path == "/_fake/capacity":
            self.set_capacity(stockout=doc.get("stockout"), quota=doc.get("quota", ""))
            return 200, {}
        return _error(404, f"fake: no control endpoint {path}")

    def _node_name(self, node_id: str) -> str:
        if node_id in self.nodes:
            return node_id
        (name,) = [n for n in self.nodes if n.endswith(f"/nodes/{node_id}")] or [None]
        if name is None:
            raise KeyError(node_id)
        return name

    # -- queued resources: the write side
    def _waiting_timeline(self, name: str) -> dict:
        """When a waiting request moves on: provisioning after `wait_s` unless the zone is stocked out,
        FAILED when its validity window closes first (the time counts from its creation)."""
        now = time.monotonic()
        when = {} if self.stockout else {"provision_at": now + self.wait_s, "active_at": now + self.wait_s + self.provision_s}
        valid = (self.queued_resources[name].get("queueingPolicy") or {}).get("validUntilDuration")
        if valid:
            when["fail_at"] = self._created[name] + float(valid.rstrip("s"))
        return when

    def _create_qr(self, parent: str, query: dict, body: dict) -> tuple[int, dict]:
        qr_id = (query.get("queuedResourceId") or [""])[0]
        if not re.fullmatch(r"[a-z]([-a-z0-9]{0,61}[a-z0-9])?", qr_id):
            return _error(400, f"Invalid queued resource id '{qr_id}'")
        name = f"{parent}/queuedResources/{qr_id}"
        if name in self.queued_resources:
            return _error(409, f"Resource '{name}' already exists")
        specs = (body.get("tpu") or {}).get("nodeSpec") or []
        if len(specs) != 1:
            return _error(400, "Exactly one nodeSpec is supported by this fake" if specs else "tpu.nodeSpec is required")
        spec, node = specs[0], specs[0].get("node") or {}
        if spec.get("parent") != parent:
            return _error(400, f"nodeSpec.parent must be '{parent}', got '{spec.get('parent')}'")
        if ("nodeId" in spec) == ("multisliceParams" in spec):
            return _error(400, "Exactly one of nodeSpec.nodeId and nodeSpec.multisliceParams must be set")
        count = int((spec.get("multisliceParams") or {}).get("nodeCount") or 1)
        if "multisliceParams" in spec and count < 2:
            return _error(400, "multisliceParams.nodeCount must be greater than 1")
        if sum(k in body for k in ("spot", "guaranteed")) > 1:
            return _error(400, "At most one of spot and guaranteed may be set")
        if node.get("runtimeVersion") not in RUNTIMES:
            return _error(400, f"Invalid runtime version '{node.get('runtimeVersion')}'; see"
                          " https://cloud.google.com/tpu/docs/runtimes")
        if ("acceleratorType" in node) == ("acceleratorConfig" in node):
            return _error(400, "Exactly one of node.acceleratorType and node.acceleratorConfig must be set")
        shape = _shape(node)
        if shape is None:
            return _error(400, f"Accelerator type {node.get('acceleratorType') or node.get('acceleratorConfig')}"
                          f" is not available in {parent.rsplit('/', 1)[1]}")
        ids = [spec["nodeId"]] if count == 1 else [
            f"{spec['multisliceParams'].get('nodeIdPrefix') or qr_id}-{i}" for i in range(count)]
        taken = [i for i in ids if f"{parent}/nodes/{i}" in self.nodes]
        if taken:
            return _error(409, f"Resource '{parent}/nodes/{taken[0]}' already exists")
        if self.quota:
            region = parent.rsplit("/", 1)[1].rsplit("-", 1)[0]
            return _error(429, f"Quota limit '{self.quota}' has been exceeded. Limit: 0 in region {region}.")
        qr = {"name": name, "createTime": _now_rfc3339(), "tpu": {"nodeSpec": [copy.deepcopy(spec)]},
              **{k: copy.deepcopy(body[k]) for k in ("spot", "guaranteed", "reservationName", "queueingPolicy")
                 if k in body},
              "state": {"state": "WAITING_FOR_RESOURCES"}}
        self.queued_resources[name] = qr
        self._created[name] = time.monotonic()
        self._timeline[name] = self._waiting_timeline(name)
        self.events.append(f"create {qr_id}")
        return 200, self._op_out(self._new_op(parent, "create", name, ("qr", name)))

    def _delete_qr(self, name: str, query: dict) -> tuple[int, dict]:
        qr = self.queued_resources.get(name)
        if qr is None:
            return _error(404, f"Resource '{name}' was not found")
        nodes = self._qr_nodes(name)
        force = (query.get("force") or ["false"])[0] == "true"
        if not force and nodes and qr["state"]["state"] not in ("ACCEPTED", "FAILED", "SUSPENDED"):
            return 400, {"error": {"code": 400, "status": "FAILED_PRECONDITION", "message":
                                   f"Queued resource '{name}' has nodes; delete them first or use force"}}
        for n in nodes:
            kill_workers(n)
            self._drop_node(n)
        qr["state"] = {"state": "DELETING"}
        took = self.op_delay_s + (self.delete_s if nodes else 0.0)
        self._timeline[name] = {"gone_at": time.monotonic() + took}
        self.events.append(f"delete {name.rsplit('/', 1)[1]}")
        return 200, self._op_out(self._new_op(name.split("/queuedResources/")[0], "delete", name, ("empty",), took))

    def _new_op(self, parent: str, verb: str, target: str, result: tuple, delay_s: float | None = None) -> dict:
        self._ops += 1
        op = {"name": f"{parent}/operations/operation-{int(time.time() * 1000)}-{self._ops:04d}",
              "metadata": {"@type": "type.googleapis.com/google.cloud.tpu.v2.OperationMetadata",
                           "createTime": _now_rfc3339(), "target": target, "verb": verb, "apiVersion": "v2"},
              "done_at": time.monotonic() + (self.op_delay_s if delay_s is None else delay_s), "result": result}
        self.operations[op["name"]] = op
        return op

    def _op_out(self, op: dict) -> dict:
        """The operation as the service returns it: only fields the client's strict parser knows."""
        out = {"name": op["name"], "metadata": dict(op["metadata"]), "done": time.monotonic() >= op["done_at"]}
        if not out["done"]:
            return out
        out["metadata"].setdefault("endTime", _now_rfc3339())
        if "response" not in op:
            if op["result"][0] == "empty":
                op["response"] = {"@type": "type.googleapis.com/google.protobuf.Empty"}
            else:
                qr = self.queued_resources.get(op["result"][1]) or {}
                known = {k: copy.deepcopy(v) for k, v in qr.items()
                         if k in ("name", "createTime", "tpu", "spot", "guaranteed", "reservationName", "queueingPolicy")}
                state = qr.get("state") or {}
                known["state"] = {k: v for k, v in state.items() if k in ("state", "stateInitiator", "failedData")}
                op["response"] = {"@type": "type.googleapis.com/google.cloud.tpu.v2.QueuedResource", **known}
        out["response"] = op["response"]
        return out

    def _advance(self) -> None:
        """Move every queued resource along its timeline (called on every request)."""
        now = time.monotonic()
        for name, when in list(self._timeline.items()):
            qr = self.queued_resources.get(name)
            if qr is None:
                del self._timeline[name]
                continue
            state = qr["state"]["state"]
            fail_at = when.get("fail_at", float("inf"))  # its window closed before it would have provisioned
            if state == "WAITING_FOR_RESOURCES" and now >= fail_at and fail_at < when.get("provision_at", float("inf")):
                qr["state"] = {"state": "FAILED", "failedData": {"error": {"code": 4, "message": EXPIRED}}}
                del self._timeline[name]
            elif state == "WAITING_FOR_RESOURCES" and now >= when.get("provision_at", float("inf")):
                qr["state"] = {"state": "PROVISIONING"}
                state = "PROVISIONING"
            if state == "PROVISIONING" and now >= when.get("active_at", float("inf")):
                self._make_nodes(qr)
                qr["state"] = {"state": "ACTIVE"}
                del self._timeline[name]
            elif state == "SUSPENDING" and now >= when.get("suspended_at", float("inf")):
                for n in self._qr_nodes(name):
                    kill_workers(n)
                    self._drop_node(n)
                qr["state"] = {"state": "SUSPENDED", "stateInitiator": "SERVICE"}
                del self._timeline[name]
            elif state == "DELETING" and now >= when.get("gone_at", float("inf")):
                del self.queued_resources[name]
                del self._timeline[name]

    def _qr_nodes(self, qr_name: str) -> list[str]:
        return sorted(n for n, node in self.nodes.items() if node.get("queuedResource") == qr_name)

    def _make_nodes(self, qr: dict) -> None:
        spec = qr["tpu"]["nodeSpec"][0]
        parent, node = spec["parent"], spec["node"]
        project, zone = parent.split("/")[1], parent.split("/")[3]
        acc, family, topo, hosts, chips_per_host = _shape(node)
        ms = spec.get("multisliceParams")
        ids = [spec["nodeId"]] if not ms else [f"{ms.get('nodeIdPrefix') or qr['name'].rsplit('/', 1)[1]}-{i}"
                                               for i in range(int(ms["nodeCount"]))]
        type_name = {v: k for k, v in _CONFIG_TYPES.items()}[family]
        for node_id in ids:
            self._subnets += 1
            ips = [f"10.{150 + self._subnets // 250}.{self._subnets % 250}.{i + 2}" for i in range(hosts)]
            made = make_node(zone, node_id, project=project, accelerator_type=acc,
                             accelerator_config={"type": type_name, "topology": topo}, ips=ips,
                             runtime_version=node["runtimeVersion"], spot="spot" in qr,
                             queued_resource=qr["name"], multislice_node=bool(ms))
            self.nodes[made["name"]] = made
            self._write_slice(f"{project}/{zone}/{node_id}", {"accelerator_type": acc, "topology": topo,
                                                              "chips_per_host": chips_per_host, "worker_ips": ips})

    def _drop_node(self, name: str) -> None:
        self.nodes.pop(name, None)
        _, project, _, zone, _, node_id = name.split("/")
        self._write_slice(f"{project}/{zone}/{node_id}", None)

    def _set_slice_state(self, name: str, state: str) -> None:
        """The fake gcloud refuses ssh to a node that is not READY, as the real one cannot reach a
        stopped VM."""
        if not self.gcloud_slices or not Path(self.gcloud_slices).exists():
            return
        _, project, _, zone, _, node_id = name.split("/")
        key = f"{project}/{zone}/{node_id}"
        entry = json.loads(Path(self.gcloud_slices).read_text()).get(key)
        if entry is not None:
            self._write_slice(key, {**entry, "state": state})

    def _write_slice(self, key: str, entry: dict | None) -> None:
        """Keep the fake gcloud's view of which VMs exist in step with the API's."""
        if not self.gcloud_slices:
            return
        path = Path(self.gcloud_slices)
        doc = json.loads(path.read_text()) if path.exists() else {}
        if entry is None:
            doc.pop(key, None)
        else:
            doc[key] = entry
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(doc))
        tmp.replace(path)

    def _list(self, parent: str, zone: str, query: dict, enc_int: bool) -> tuple[int, dict]:
        if zone == "-":
            prefix = parent.rsplit("/locations/", 1)[0] + "/locations/"
            names = sorted(n for n in self.nodes if n.startswith(prefix))
        else:
            names = sorted(n for n in self.nodes if n.startswith(parent + "/nodes/"))
        try:
            size = int(query.get("pageSize", ["0"])[0] or 0)
            start = int(query.get("pageToken", [""])[0].removeprefix("offset-") or 0)
        except ValueError:
            return _error(400, "Invalid page token or page size")
        if size < 0 or start < 0 or start > len(names):
            return _error(400, "Invalid page token or page size")
        size = min(size or self.default_page_size or self.max_page_size, self.max_page_size)
        page = names[start:start + size]
        doc: dict[str, Any] = {}
        if page:
            doc["nodes"] = [self._out(self.nodes[n], enc_int) for n in page]
        if start + size < len(names):
            doc["nextPageToken"] = f"offset-{start + size}"
        return 200, doc

    def _out(self, node: dict, enc_int: bool) -> dict:
        node = copy.deepcopy(node)
        if enc_int:
            _to_int(node, "state", _STATE)
            _to_int(node, "health", _HEALTH)
            _to_int(node.get("acceleratorConfig", {}), "type", _TYPE)
            for s in node.get("symptoms", []):
                _to_int(s, "symptomType", _SYMPTOM)
        return node

    def _out_qr(self, qr: dict, enc_int: bool) -> dict:
        qr = copy.deepcopy(qr)
        if enc_int:
            _to_int(qr.get("state", {}), "state", _QR_STATE)
        return qr


def _shape(node: dict) -> tuple[str, str, str, int, int] | None:
    """(acceleratorType, family, topology, hosts, chips per host) of a node spec, or None if the
    service would not know it."""
    if "acceleratorConfig" in node:
        cfg = node["acceleratorConfig"]
        t = cfg.get("type")
        t = {v: k for k, v in _TYPE.items()}.get(t, t) if isinstance(t, int) else t
        family, topo = _CONFIG_TYPES.get(t or ""), cfg.get("topology") or ""
        if family is None or not re.fullmatch(r"\d+(x\d+){1,2}", topo):
            return None
        chips = 1
        for d in topo.split("x"):
            chips *= int(d)
        acc = f"{family}-{chips * _FAMILY[family][0]}"
    else:
        acc = node.get("acceleratorType") or ""
        family, _, n = acc.partition("-")
        topo = _TYPE_TOPOLOGY.get(acc)
        if family not in _FAMILY or topo is None:
            return None
        chips = int(n) // _FAMILY[family][0]
    per_host = chips if family in ("v5litepod", "v6e") and chips <= 8 else min(chips, _FAMILY[family][1])
    return acc, family, topo, chips // per_host, per_host


def kill_workers(node_name: str, shutdown_s: float = 0.0) -> list[int]:
    """SIGKILL every process the fake gcloud started on a VM of `node_name` (they carry
    FAKE_GCLOUD_VM=project/zone/node/worker), then wipe those VMs' disks (their /tmp copies): what
    a preempted or deleted VM leaves behind is nothing. With `shutdown_s`, the processes with no
    child among them (the scripts) go first and the others `shutdown_s` later."""
    node_id = node_name.rsplit("/", 1)[1]
    found = _vm_processes([node_name])
    leaves = [p for p in found if p not in found.values()] if shutdown_s else []
    killed = []
    for batch in (leaves, [p for p in found if p not in leaves]):
        for pid in batch:
            try:
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
            except OSError:
                pass
        if batch is leaves and leaves:
            time.sleep(shutdown_s)
    end = time.monotonic() + 10
    while killed and time.monotonic() < end and any(_alive(p) for p in killed):
        time.sleep(0.05)
    tag = f"-vm{zlib.crc32(node_id.encode()) & 0xFFFF:04x}-"  # the fake gcloud's vm_tmp() names them so
    for d in glob.glob(f"/tmp/*{tag}*"):
        shutil.rmtree(d, ignore_errors=True)
    return killed


def end_vms(slices_file: str | Path) -> int:
    """SIGKILL the init of every VM the fake gcloud made for `slices_file` (it records them beside
    it), which ends everything under it; for tests that use the fake gcloud with no fake API."""
    ended = 0
    for f in glob.glob(glob.escape(str(slices_file)) + ".vm-*.pid"):
        try:
            pid = int(Path(f).read_text())
            if b"FAKE_GCLOUD_VM=" in Path(f"/proc/{pid}/environ").read_bytes():
                os.kill(pid, signal.SIGKILL)
                ended += 1
        except (OSError, ValueError):
            pass
    return ended


def _vm_processes(node_names: list[str]) -> dict[int, int]:
    """pid -> ppid of every process on a VM of one of `node_names` (by the fake gcloud's mark)."""
    marks = []
    for n in node_names:
        _, project, _, zone, _, node_id = n.split("/")
        marks.append(f"FAKE_GCLOUD_VM={project}/{zone}/{node_id}/".encode())
    found: dict[int, int] = {}
    if not marks:
        return found
    for e in os.listdir("/proc"):
        if not e.isdigit() or int(e) == os.getpid():
            continue
        try:
            env = Path(f"/proc/{e}/environ").read_bytes()
            if b"FAKE_GCLOUD_VM=" not in env or not any(v.startswith(tuple(marks)) for v in env.split(b"\0")):
                continue
            found[int(e)] = int(Path(f"/proc/{e}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
    return found


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] not in "ZX"
    except OSError:
        return False


def _now_rfc3339() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S.000000Z", time.gmtime())


def _to_int(doc: dict, key: str, table: dict[str, int]) -> None:
    if isinstance(doc.get(key), str) and doc[key] in table:
        doc[key] = table[doc[key]]


def _error(code: int, message: str, reason: str | None = None, metadata: dict | None = None) -> tuple[int, dict]:
    err: dict[str, Any] = {"code": code, "message": message, "status": _STATUS.get(code, "UNKNOWN")}
    if reason:
        err["details"] = [{
            "@type": "type.googleapis.com/google.rpc.ErrorInfo",
            "reason": reason, "domain": "googleapis.com" if reason == "SERVICE_DISABLED" else "tpu.googleapis.com",
            "metadata": metadata or {},
        }]
    return code, {"error": err}


class _Handler(BaseHTTPRequestHandler):
    api: FakeTpuApi
    protocol_version = "HTTP/1.1"

    def _serve(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length) if length else b""
        code, doc = self.api.handle(self.command, self.path, self.headers, body)
        body = json.dumps(doc).encode()
        try:
            self.send_response(code)
            self.send_header("Content-Type", "application/json; charset=UTF-8")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if self.api.mode == "trickle":
                for i in range(len(body)):
                    if self.api._stop.wait(0.5):
                        return
                    self.wfile.write(body[i:i + 1])
                    self.wfile.flush()
            else:
                self.wfile.write(body)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the client gave up (timeout tests)

    do_GET = do_POST = do_PATCH = do_DELETE = do_PUT = _serve

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - stdlib signature
        pass
