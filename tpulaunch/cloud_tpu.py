"""The Cloud TPU API (`tpu.googleapis.com`, v2) client: one bounded call at a time.

The only module that imports `google.cloud.tpu_v2`, and only inside functions so that
`tpulaunch --help` stays fast. It uses the real `TpuClient` over REST, so tests point it at an
HTTP fake (`TPULAUNCH_TPU_API_ENDPOINT=http://127.0.0.1:PORT`) instead of mocking the client.
Discovery (`discover.tpu_api`: nodes -> `SliceSpec`) and provisioning (`provision.capacity`:
queued resources made and deleted) both use it.

Every call is bounded: one deadline per operation (default 10 s, `TPULAUNCH_API_TIMEOUT` or the
`timeout` argument), passed to each HTTP request with retries off, and a watchdog thread as a
backstop so that even a server that trickles bytes cannot hold the command past the deadline.
"""

from __future__ import annotations

import math
import re
import threading
import time
import warnings
from collections.abc import Callable
from typing import Any, TypeVar
from urllib.parse import urlsplit

from tpulaunch import settings
from tpulaunch.errors import (
    ApiPermissionError,
    ApiUnreachableError,
    CapacityError,
    CredentialsError,
    DiscoveryError,
    NameTakenError,
    NodeNotFoundError,
    TpulaunchError,
)

ENDPOINT_ENV = "TPULAUNCH_TPU_API_ENDPOINT"
TIMEOUT_ENV = "TPULAUNCH_API_TIMEOUT"
DEFAULT_ENDPOINT = "tpu.googleapis.com"
DEFAULT_TIMEOUT = 10.0
# Queued-resource states its slice does not come back from by itself (preempted, or the request failed).
QR_GONE_BAD = ("SUSPENDING", "SUSPENDED", "FAILED")
_SCOPES = ("https://www.googleapis.com/auth/cloud-platform",)
_LOCAL_HOSTS = {"localhost", "127.0.0.1", "::1"}
_ADC_HINT = "run `gcloud auth application-default login` (or set GOOGLE_APPLICATION_CREDENTIALS to a key file)"


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
        except BaseException as e:  # re-raised in the caller's thread
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
    def run(self, fn: Callable[[TpuApi], T]) -> T:
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
        except Exception:  # errors are the client's business
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
        except Exception as e:  # mapped to one readable line
            raise self.map_error(e, resource=resource, permission=permission) from None

    # -- errors ---------------------------------------------------------------------------------
    def map_error(self, e: Exception, *, resource: str, permission: str) -> TpulaunchError:
        """Turn a client/transport exception into one line that says what to do."""
        import requests
        from google.api_core import exceptions as core
        from google.auth import exceptions as auth_exc

        where = _display_endpoint(self.endpoint)
        project = path_part(resource, "projects") or "<project>"
        if isinstance(e, core.NotFound):
            return NodeNotFoundError(f"{resource} not found", "check the name and --zone/--project")
        if isinstance(e, core.Conflict):
            return NameTakenError(f"{_short(resource)} already exists",
                                  "delete it first (tpulaunch slice delete NAME), or pick another name")
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
        return DiscoveryError(f"could not read {resource} from the Cloud TPU API: {type(e).__name__}:"
                              f" {_one_line(str(e), 160)}")


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


def path_part(path: str, key: str) -> str | None:
    """The part after `key` in a resource path (`projects/P/locations/Z/...`: "projects" -> P)."""
    parts = path.split("/")
    for i, p in enumerate(parts[:-1]):
        if p == key:
            return parts[i + 1]
    return None
