"""Cloud TPU API (`tpu.googleapis.com`, v2) -> `SliceSpec`.

The only module that imports `google.cloud.tpu_v2`, and only inside functions so that
`tpulaunch --help` stays fast. It uses the real `TpuClient` over REST, so tests point it at an
HTTP fake (`TPULAUNCH_TPU_API_ENDPOINT=http://127.0.0.1:PORT`) instead of mocking the client.

Every call is bounded: one deadline per operation (default 10 s, `TPULAUNCH_API_TIMEOUT` or the
`timeout` argument), passed to each HTTP request with retries off, and a watchdog thread as a
backstop so that even a server that trickles bytes cannot hold the command past the deadline.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import re
import threading
import time
import warnings
from typing import Any, Callable, TypeVar
from urllib.parse import urlsplit

from tpulaunch.plan import topology as topo_mod
from tpulaunch import settings
from tpulaunch.errors import (
    ApiPermissionError,
    CapacityError,
    ApiUnreachableError,
    CredentialsError,
    DiscoveryError,
    NameTakenError,
    NodeNotFoundError,
    SliceNotReadyError,
    TopologyError,
    TpulaunchError,
)
from tpulaunch.plan.slicespec import SliceSpec, WorkerEndpoint

ENDPOINT_ENV = "TPULAUNCH_TPU_API_ENDPOINT"
TIMEOUT_ENV = "TPULAUNCH_API_TIMEOUT"
DEFAULT_ENDPOINT = "tpu.googleapis.com"
DEFAULT_TIMEOUT = 10.0
# Queued-resource states its slice does not come back from by itself (preempted, or the request failed).
QR_GONE_BAD = ("SUSPENDING", "SUSPENDED", "FAILED")
_SCOPES = ("https://www.googleapis.com/auth/cloud-platform",)
_LOCAL_HOSTS = {"localhost", "127.0.0.1", "::1"}
_ADC_HINT = "run `gcloud auth application-default login` (or set GOOGLE_APPLICATION_CREDENTIALS to a key file)"

# AcceleratorConfig.Type names -> accelerator-type prefix (generation name for the catalog).
_CONFIG_TYPE_PREFIX = {"V5LITE_POD": "v5litepod"}

T = TypeVar("T")


# -- settings -----------------------------------------------------------------------------------


def api_timeout(timeout: float | None = None) -> float:
    """The per-operation time budget: argument, then `TPULAUNCH_API_TIMEOUT`, then 10 s."""
    if timeout is None:
        return settings.seconds(TIMEOUT_ENV, DEFAULT_TIMEOUT)
    if not math.isfinite(timeout) or timeout <= 0:
        raise TpulaunchError(f"API timeout must be a positive number of seconds, not {timeout:g}")
    return float(timeout)


def api_endpoint(endpoint: str | None = None) -> str | None:
    """The endpoint override (argument, then `TPULAUNCH_TPU_API_ENDPOINT`), or None for Google's."""
    return settings.endpoint(ENDPOINT_ENV, endpoint)


def is_local_test_endpoint(endpoint: str | None) -> bool:
    """True for `http://localhost|127.0.0.1|[::1][:port]`: the only place anonymous calls go."""
    if not endpoint:
        return False
    parts = urlsplit(endpoint)
    return parts.scheme == "http" and (parts.hostname or "") in _LOCAL_HOSTS


def _display_endpoint(endpoint: str | None) -> str:
    return endpoint or f"https://{DEFAULT_ENDPOINT}"


# -- the bounded call ---------------------------------------------------------------------------


class _Deadline:
    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self._end = time.monotonic() + seconds

    def remaining(self) -> float:
        left = self._end - time.monotonic()
        if left <= 0:
            raise TimeoutError("deadline reached")
        return left


def _bounded(fn: Callable[[], T], seconds: float, on_timeout: Callable[[], Exception]) -> T:
    """Run `fn` in a daemon thread and give up after `seconds`: the budget holds whatever the server does."""
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread
            box["error"] = e

    t = threading.Thread(target=target, name="tpulaunch-tpu-api", daemon=True)
    t.start()
    t.join(seconds + 0.25)  # a hair of grace so a transport timeout at the deadline reports itself
    if t.is_alive():
        raise on_timeout()
    if "error" in box:
        raise box["error"]
    return box["value"]


class TpuApi:
    """One Cloud TPU API session for one operation: endpoint, credentials, deadline.

    Also records the raw JSON of every node it sees, because the client drops enum strings it
    does not know (an `acceleratorConfig.type` of `V7X` parses as TYPE_UNSPECIFIED).
    """

    def __init__(self, *, endpoint: str | None = None, timeout: float | None = None) -> None:
        self.endpoint = api_endpoint(endpoint)
        self.timeout = api_timeout(timeout)
        self.raw_nodes: dict[str, dict] = {}
        self._client: Any = None
        self._deadline: _Deadline | None = None

    # The public entry: everything inside `fn(api)` shares one deadline.
    def run(self, fn: Callable[["TpuApi"], T]) -> T:
        self._deadline = _Deadline(self.timeout)
        return _bounded(lambda: fn(self), self.timeout, self._timeout_error)

    def _timeout_error(self) -> ApiUnreachableError:
        return ApiUnreachableError(
            f"the Cloud TPU API at {_display_endpoint(self.endpoint)} did not answer within {self.timeout:g} s",
            f"check network access to it, or allow more time with --timeout / {TIMEOUT_ENV}",
        )

    def _remaining(self) -> float:
        assert self._deadline is not None, "use TpuApi.run()"
        try:
            return self._deadline.remaining()
        except TimeoutError:
            raise self._timeout_error() from None

    # -- client -------------------------------------------------------------------------------
    def client(self) -> Any:
        if self._client is None:
            self._client = self._make_client()
        return self._client

    def _credentials(self) -> Any:
        if is_local_test_endpoint(self.endpoint):
            from google.auth.credentials import AnonymousCredentials

            return AnonymousCredentials()
        import google.auth
        from google.auth import exceptions as auth_exc

        try:
            creds, _project = google.auth.default(scopes=list(_SCOPES))
        except auth_exc.DefaultCredentialsError as e:
            reason = _one_line(str(e), 160)
            raise CredentialsError(f"no Google Cloud credentials found ({reason})", _ADC_HINT) from None
        return creds

    def _make_client(self) -> Any:
        from google.api_core.client_options import ClientOptions
        from google.cloud import tpu_v2

        creds = self._credentials()
        options = ClientOptions(api_endpoint=self.endpoint) if self.endpoint else None
        client = tpu_v2.TpuClient(credentials=creds, transport="rest", client_options=options)
        session = getattr(client.transport, "_session", None)
        if session is not None and hasattr(session, "hooks"):
            session.hooks.setdefault("response", []).append(self._record_raw)
        return client

    def _record_raw(self, response: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            doc = response.json()
        except Exception:  # noqa: BLE001 - errors are the client's business
            return response
        if isinstance(doc, dict):
            for node in doc.get("nodes", []) if isinstance(doc.get("nodes"), list) else [doc]:
                if isinstance(node, dict) and "/nodes/" in str(node.get("name", "")):
                    self.raw_nodes[node["name"]] = node
        return response

    # -- calls (inside run()) -------------------------------------------------------------------
    def get_node(self, name: str) -> Any:
        return self._call("get", name, "tpu.nodes.get", lambda c, t: c.get_node(name=name, retry=None, timeout=t))

    def list_nodes(self, parent: str, page_size: int | None = None) -> list[Any]:
        from google.cloud import tpu_v2

        def call(c: Any, t: float) -> list[Any]:
            request = tpu_v2.ListNodesRequest(parent=parent, page_size=page_size or 0)
            nodes = []
            pager = c.list_nodes(request=request, retry=None, timeout=t)
            for page in pager.pages:  # follows nextPageToken; the watchdog bounds the total
                nodes.extend(page.nodes)
            return nodes

        return self._call("list", parent, "tpu.nodes.list", call)

    def get_queued_resource(self, name: str) -> Any:
        return self._call(
            "get", name, "tpu.queuedResources.get",
            lambda c, t: c.get_queued_resource(name=name, retry=None, timeout=t),
        )

    def list_queued_resources(self, parent: str) -> list[Any]:
        from google.cloud import tpu_v2

        def call(c: Any, t: float) -> list[Any]:
            out = []
            for page in c.list_queued_resources(request=tpu_v2.ListQueuedResourcesRequest(parent=parent), retry=None,
                                                timeout=t).pages:
                out.extend(page.queued_resources)
            return out

        return self._call("list", parent, "tpu.queuedResources.list", call)

    def create_queued_resource(self, parent: str, qr_id: str, body: dict, request_id: str) -> Any:
        """Start creating a queued resource (`body`: its REST JSON); returns the long-running
        operation, already checked by the service's validation."""
        import json

        from google.cloud import tpu_v2

        qr = tpu_v2.QueuedResource.from_json(json.dumps(body))
        request = tpu_v2.CreateQueuedResourceRequest(parent=parent, queued_resource_id=qr_id, queued_resource=qr,
                                                     request_id=request_id)
        return self._call("create", f"{parent}/queuedResources/{qr_id}", "tpu.queuedResources.create",
                          lambda c, t: c.create_queued_resource(request=request, retry=None, timeout=t))

    def delete_queued_resource(self, name: str, request_id: str, force: bool = True) -> Any:
        from google.cloud import tpu_v2

        request = tpu_v2.DeleteQueuedResourceRequest(name=name, force=force, request_id=request_id)
        return self._call("delete", name, "tpu.queuedResources.delete",
                          lambda c, t: c.delete_queued_resource(request=request, retry=None, timeout=t))

    def operation_result(self, op: Any, resource: str, permission: str) -> Any:
        """Wait (within the deadline) for a long-running operation; its result, or its error mapped."""
        return self._call("wait", resource, permission, lambda _c, t: op.result(timeout=t))

    def _call(self, verb: str, resource: str, permission: str, fn: Callable[[Any, float], T]) -> T:
        client = self.client()
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)
                return fn(client, self._remaining())
        except TpulaunchError:
            raise
        except Exception as e:  # noqa: BLE001 - mapped to one readable line
            raise self.map_error(e, resource=resource, permission=permission) from None

    # -- errors ---------------------------------------------------------------------------------
    def map_error(self, e: Exception, *, resource: str, permission: str) -> TpulaunchError:
        """Turn a client/transport exception into one line that says what to do."""
        import requests
        from google.api_core import exceptions as core
        from google.auth import exceptions as auth_exc

        where = _display_endpoint(self.endpoint)
        project = _path_part(resource, "projects") or "<project>"
        if isinstance(e, core.NotFound):
            return NodeNotFoundError(f"{resource} not found", "check the name and --zone/--project")
        if isinstance(e, core.Conflict):
            return NameTakenError(f"{_short(resource)} already exists", "delete it first (tpulaunch slice delete NAME), or pick"
                                 " another name")
        if isinstance(e, core.TooManyRequests):  # 429 quota on the call, or RESOURCE_EXHAUSTED (8) in the operation
            return CapacityError(f"the Cloud TPU API has no room for {_short(resource)}: {_service_text(e)}",
                                 "request more quota, or try another zone or tier (--spot, --reserved)")
        if isinstance(e, (core.BadRequest, core.InvalidArgument, core.FailedPrecondition)):
            return CapacityError(f"the Cloud TPU API refused {_short(resource)}: {_service_text(e)}",
                                 "check the accelerator type, the runtime version (--runtime-version) and the zone")
        if isinstance(e, (core.PermissionDenied, core.Forbidden)):
            text = f"{getattr(e, 'reason', '') or ''} {e.message}"
            if "SERVICE_DISABLED" in text or "has not been used" in text or "is disabled" in text:
                return ApiPermissionError(
                    f"the Cloud TPU API (tpu.googleapis.com) is not enabled in project {project}",
                    f"enable it: gcloud services enable tpu.googleapis.com --project {project}",
                )
            named = (getattr(e, "metadata", None) or {}).get("permission") or permission
            return ApiPermissionError(
                f"permission denied: your credentials lack '{named}' on {resource}",
                f"grant a role that has {named} (e.g. roles/tpu.viewer) on project {project}, and check"
                " that the Cloud TPU API (tpu.googleapis.com) is enabled there",
            )
        if isinstance(e, (core.Unauthenticated, core.Unauthorized, auth_exc.RefreshError)):
            return CredentialsError(
                f"the Cloud TPU API rejected your credentials ({_one_line(str(e), 120)})", _ADC_HINT
            )
        if isinstance(e, (requests.exceptions.Timeout, core.DeadlineExceeded, TimeoutError)):
            return self._timeout_error()
        if isinstance(e, (requests.exceptions.ConnectionError, auth_exc.TransportError)):
            return ApiUnreachableError(
                f"could not reach the Cloud TPU API at {where} ({_connection_reason(e)})",
                f"check network/proxy access, or {ENDPOINT_ENV} if you set it",
            )
        if isinstance(e, core.GoogleAPICallError):
            code = getattr(e, "code", None)
            return DiscoveryError(
                f"the Cloud TPU API answered {code or 'an error'} for {resource}: {_one_line(e.message or str(e), 200)}"
            )
        if isinstance(e, requests.exceptions.RequestException):
            return ApiUnreachableError(f"request to the Cloud TPU API at {where} failed ({_one_line(str(e), 160)})")
        return DiscoveryError(f"could not read {resource} from the Cloud TPU API: {type(e).__name__}: {_one_line(str(e), 160)}")


def _short(resource: str) -> str:
    """`projects/p/locations/z/queuedResources/x` -> `queued resource x` (the zone is said elsewhere)."""
    kind, _, name = resource.rpartition("/")
    kind = kind.rsplit("/", 1)[-1]
    return {"queuedResources": f"queued resource {name}", "nodes": f"node {name}"}.get(kind, resource)


def _service_text(e: Exception) -> str:
    """The service's own message, without api-core's `POST http://...: ` prefix."""
    text = getattr(e, "message", None) or str(e)
    text = re.sub(r"^(GET|POST|DELETE|PATCH|PUT) \S+: ", "", text)
    return _one_line(text, 300)


def _one_line(text: str, limit: int) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _connection_reason(e: Exception) -> str:
    text = str(e)
    for needle, reason in (
        ("Connection refused", "connection refused"),
        ("Name or service not known", "host name not found"),
        ("nodename nor servname", "host name not found"),
        ("Temporary failure in name resolution", "host name not found"),
        ("No route to host", "no route to host"),
        ("Network is unreachable", "network unreachable"),
        ("Connection reset", "connection reset"),
        ("RemoteDisconnected", "connection closed by the server"),
    ):
        if needle in text:
            return reason
    return type(e).__name__


def _path_part(path: str, key: str) -> str | None:
    parts = path.split("/")
    for i, p in enumerate(parts[:-1]):
        if p == key:
            return parts[i + 1]
    return None


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
            zone=_path_part(full, "locations"),
            project=_path_part(full, "projects"),
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
