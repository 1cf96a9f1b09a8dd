"""A fake Cloud TPU API v2 over HTTP, for the real `google.cloud.tpu_v2.TpuClient(transport="rest")`.

It serves the real REST paths and JSON (camelCase fields, enums as names, or as numbers when
`int_enums=True` and the client asks for `enum-encoding=int`, like the real service), pages with
`pageSize`/`pageToken`/`nextPageToken`, and answers errors in Google's JSON error format. Anything
that is not a real path is rejected (and recorded in `rejected`, so tests can assert there was none).

    with FakeTpuApi(standard_nodes(), standard_queued_resources()) as api:
        env["TPULAUNCH_TPU_API_ENDPOINT"] = api.url

Modes: "ok"; "forbidden" (403 PERMISSION_DENIED naming the permission, for everything or only
the permissions in `denied`); "disabled" (403 SERVICE_DISABLED); "slow" (sleeps `slow_seconds`
before answering, longer than any client timeout in the tests); "trickle" (sends the headers at
once, then the body one byte every 0.5 s, so no single socket read ever times out).
"""

from __future__ import annotations

import copy
import json
import re
import threading
import zlib
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
]
_STATUS = {400: "INVALID_ARGUMENT", 403: "PERMISSION_DENIED", 404: "NOT_FOUND", 405: "METHOD_NOT_ALLOWED", 501: "UNIMPLEMENTED"}


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
        int_enums: bool = False,
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
        self._stop.set()
        if self._server:
            self._server.shutdown()
            self._server.server_close()

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
    def handle(self, method: str, raw_path: str, headers: Any) -> tuple[int, dict]:
        parts = urlsplit(raw_path)
        query = parse_qs(parts.query, keep_blank_values=True)
        for alt in query.get("$alt", []):  # `$alt=json;enum-encoding=int`
            for item in alt.split(";")[1:]:
                key, _, value = item.partition("=")
                query.setdefault(key, []).append(value)
        record = {"method": method, "path": parts.path, "query": query,
                  "authorization": headers.get("Authorization")}
        self.requests.append(record)
        for route, pattern, permission in _ROUTES:
            m = pattern.match(parts.path)
            if m:
                break
        else:
            self.rejected.append(f"{method} {raw_path}")
            return _error(404, f"fake Cloud TPU API: {parts.path} is not a Cloud TPU API v2 path")
        record["route"] = route
        if method != "GET":
            self.rejected.append(f"{method} {raw_path}")
            return _error(501, f"fake Cloud TPU API: {method} {parts.path} is not implemented")
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
        if route == "get_qr":
            name = parts.path.removeprefix("/v2/")
            qr = self.queued_resources.get(name)
            if qr is None:
                return _error(404, f"Resource '{name}' was not found")
            return 200, self._out_qr(qr, enc_int)
        qrs = [self._out_qr(q, enc_int) for n, q in sorted(self.queued_resources.items())
               if n.startswith(f"projects/{project}/locations/{zone}/")]
        return 200, {"queuedResources": qrs} if qrs else {}

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
        if length:
            self.rfile.read(length)
        code, doc = self.api.handle(self.command, self.path, self.headers)
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
