"""A fake Kubernetes API server: an in-memory object store, served over HTTPS as the real one serves it.

tpulaunch talks to GKE through the official `kubernetes` client (and users through kubectl), so the
fake speaks the wire protocol, not our calls: discovery, CRUD with resourceVersions, JSON merge /
JSON / strategic-merge patches, label and field selectors, paged lists, chunked watches with
bookmarks and 410 Gone, Status errors shaped like the real ones (401, 403 from an RBAC stand-in,
404, 409, 415, 422), server-side tables for kubectl, and pod port-forward over WebSocket
(`v4.channel.k8s.io`, the protocol the python client speaks). It refuses what the real server
refuses: a RayCluster that breaks KubeRay's CRD schema (422), a strategic-merge patch of a custom
resource (415), an update with a stale resourceVersion (409), an object in a namespace that does
not exist (404).

    store = Store()
    api = ApiServer(store, tokens={"t0ken": "admin"})
    url = api.start()
    api.kubeconfig(tmp / "kubeconfig")          # certificate-authority-data + token user
    ...
    api.stop()

`Store` is also the in-process API the fake controllers (kubelet, KubeRay) use: the same objects,
resourceVersions and watch events as the HTTP side, with admission hooks (`on_create`) standing in
for mutating and validating webhooks. Garbage collection of dependents (ownerReferences) is done
synchronously when the owner goes, with the background/foreground/orphan policies.

Left out: server-side apply, SPDY (kubectl's port-forward), /openapi, exec/attach/logs, graceful pod
deletion (a deleted pod is gone at once, unless it has finalizers), ServiceAccount token volumes.
"""

from __future__ import annotations

import base64
import collections
import copy
import datetime as dt
import hashlib
import ipaddress
import json
import os
import random
import re
import select
import socket
import ssl
import struct
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Callable, Iterable
from urllib.parse import parse_qs, urlsplit

from . import selectors
from .tls import make_pki
from ..kuberay import crd

# -- errors: each one is a Kubernetes Status ------------------------------------------------------


class ApiError(Exception):
    """An API failure, answered as a `Status` object (kind Status, status Failure) with its HTTP code."""

    code = 500
    reason = "InternalError"

    def __init__(self, message: str, details: dict | None = None, *, code: int | None = None,
                 reason: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.details = details
        if code is not None:
            self.code = code
        if reason is not None:
            self.reason = reason

    def status(self) -> dict:
        return status_doc(self.code, self.reason, self.message, self.details)


class BadRequest(ApiError):
    code, reason = 400, "BadRequest"


class Unauthorized(ApiError):
    code, reason = 401, "Unauthorized"


class Forbidden(ApiError):
    code, reason = 403, "Forbidden"


class NotFound(ApiError):
    code, reason = 404, "NotFound"


class MethodNotAllowed(ApiError):
    code, reason = 405, "MethodNotAllowed"


class Conflict(ApiError):
    """409: the name is taken (reason AlreadyExists) or the update lost a race (reason Conflict)."""

    code, reason = 409, "Conflict"


class Gone(ApiError):
    """410: the asked resourceVersion is older than the history the server keeps."""

    code, reason = 410, "Expired"


class UnsupportedMediaType(ApiError):
    code, reason = 415, "UnsupportedMediaType"


class Invalid(ApiError):
    """422: the object breaks validation. `messages` are `<field>: <detail>` lines (the causes)."""

    code, reason = 422, "Invalid"

    def __init__(self, messages: list[str] | str, *, kind: str = "", group: str = "", name: str = "",
                 code: int | None = None) -> None:
        self.messages = [messages] if isinstance(messages, str) else list(messages)
        self.kind, self.group, self.name = kind, group, name
        super().__init__(self._text(), code=code)

    def _text(self) -> str:
        errs = self.messages[0] if len(self.messages) == 1 else "[" + ", ".join(self.messages) + "]"
        if not self.kind:
            return errs
        qualified = f"{self.kind}.{self.group}" if self.group else self.kind
        return f'{qualified} "{self.name}" is invalid: {errs}'

    def with_object(self, kind: str, group: str, name: str) -> "Invalid":
        if not self.kind:
            self.kind, self.group, self.name = kind, group, name
            self.message = self._text()
            self.args = (self.message,)
        return self

    def status(self) -> dict:
        causes = []
        for m in self.messages:
            fld, sep, detail = m.partition(": ")
            if not sep:
                fld, detail = "", m
            reason = ("FieldValueRequired" if detail.startswith("Required value") else
                      "FieldValueNotSupported" if detail.startswith("Unsupported value") else
                      "FieldValueDuplicate" if detail.startswith("Duplicate value") else
                      "FieldValueForbidden" if detail.startswith("Forbidden") else
                      "FieldValueTooLong" if detail.startswith("Too long") else "FieldValueInvalid")
            causes.append({"reason": reason, "message": detail, "field": fld})
        details: dict[str, Any] = {"name": self.name}
        if self.group:
            details["group"] = self.group
        details["kind"] = self.kind
        details["causes"] = causes
        return status_doc(self.code, self.reason, self.message, details)


def status_doc(code: int, reason: str, message: str, details: dict | None = None) -> dict:
    doc: dict[str, Any] = {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
                           "message": message, "reason": reason}
    if details is not None:
        doc["details"] = details
    doc["code"] = code
    return doc


# -- resources ------------------------------------------------------------------------------------

ALL_VERBS = ("create", "delete", "deletecollection", "get", "list", "patch", "update", "watch")


@dataclass(frozen=True)
class Resource:
    plural: str
    kind: str
    group: str
    version: str
    namespaced: bool
    singular: str
    short_names: tuple[str, ...] = ()
    categories: tuple[str, ...] = ()
    verbs: tuple[str, ...] = ALL_VERBS
    subresources: tuple[str, ...] = ()
    name_rule: str = "subdomain"  # how metadata.name is validated: subdomain | label | label1035 | path

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}" if self.group else self.version

    @property
    def qualified(self) -> str:
        """`pods`, `rayclusters.ray.io`: how error messages name the resource."""
        return f"{self.plural}.{self.group}" if self.group else self.plural

    @property
    def is_crd(self) -> bool:
        return self.group == crd.GROUP


RBAC = "rbac.authorization.k8s.io"
RESOURCES: dict[str, Resource] = {r.plural: r for r in (
    Resource("namespaces", "Namespace", "", "v1", False, "namespace", ("ns",),
             verbs=("create", "delete", "get", "list", "patch", "update", "watch"), subresources=("status",),
             name_rule="label"),
    Resource("nodes", "Node", "", "v1", False, "node", ("no",), subresources=("status",)),
    Resource("pods", "Pod", "", "v1", True, "pod", ("po",), ("all",),
             subresources=("status", "portforward", "binding")),
    Resource("services", "Service", "", "v1", True, "service", ("svc",), ("all",), subresources=("status",),
             name_rule="label1035"),
    Resource("secrets", "Secret", "", "v1", True, "secret"),
    Resource("serviceaccounts", "ServiceAccount", "", "v1", True, "serviceaccount", ("sa",)),
    Resource("events", "Event", "", "v1", True, "event", ("ev",)),
    Resource("roles", "Role", RBAC, "v1", True, "role", name_rule="path"),
    Resource("rolebindings", "RoleBinding", RBAC, "v1", True, "rolebinding", name_rule="path"),
    Resource("clusterroles", "ClusterRole", RBAC, "v1", False, "clusterrole", name_rule="path"),
    Resource("clusterrolebindings", "ClusterRoleBinding", RBAC, "v1", False, "clusterrolebinding", name_rule="path"),
    Resource(crd.PLURAL, crd.KIND, crd.GROUP, "v1", True, "raycluster", (), ("all",), subresources=("status",)),
)}
# Served, never stored: `kubectl auth can-i` asks the RBAC stand-in through it.
SSAR = Resource("selfsubjectaccessreviews", "SelfSubjectAccessReview", "authorization.k8s.io", "v1", False,
                "selfsubjectaccessreview", verbs=("create",))
# Types whose main endpoint ignores .status (it is written through /status).
_STATUS_SPLIT = {"namespaces", "nodes", "pods", "services", crd.PLURAL}
# Types whose metadata.generation moves with their spec (CRDs always; these pods do not have it in 1.32).
_GENERATION = {crd.PLURAL}
DEFAULT_NAMESPACES = ("default", "kube-system", "kube-public", "kube-node-lease")
_NAME_CHARS = "bcdfghjklmnpqrstvwxz2456789"  # k8s.io/apimachinery/pkg/util/rand: no vowels, no 0/1/3


def resource(plural: str) -> Resource:
    try:
        return RESOURCES[plural]
    except KeyError:
        raise NotFound("the server could not find the requested resource", {}) from None


def now_rfc3339() -> str:
    return dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _copy(obj: Any) -> Any:
    return copy.deepcopy(obj)


# -- name validation (k8s.io/apimachinery/pkg/util/validation) -----------------------------------

_DNS1123_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_DNS1035_LABEL = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
_SUBDOMAIN_MSG = ("a lowercase RFC 1123 subdomain must consist of lower case alphanumeric characters, '-' or '.', "
                  "and must start and end with an alphanumeric character (e.g. 'example.com', regex used for "
                  "validation is '[a-z0-9]([-a-z0-9]*[a-z0-9])?(\\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*')")
_LABEL_MSG = ("a lowercase RFC 1123 label must consist of lower case alphanumeric characters or '-', and must start "
              "and end with an alphanumeric character (e.g. 'my-name',  or '123-abc', regex used for validation is "
              "'[a-z0-9]([-a-z0-9]*[a-z0-9])?')")
_1035_MSG = ("a DNS-1035 label must consist of lower case alphanumeric characters or '-', start with an alphabetic "
             "character, and end with an alphanumeric character (e.g. 'my-name',  or 'abc-123', regex used for "
             "validation is '[a-z]([-a-z0-9]*[a-z0-9])?')")


def _name_errors(rule: str, name: str) -> list[str]:
    bad = f'metadata.name: Invalid value: "{name}": '
    if rule == "path":
        return [bad + f"may not contain '{c}'" for c in ("/", "%") if c in name] + (
            [bad + f"may not be '{name}'"] if name in (".", "..") else [])
    if rule == "label":
        ok, limit, msg = _DNS1123_LABEL.match(name), 63, _LABEL_MSG
    elif rule == "label1035":
        ok, limit, msg = _DNS1035_LABEL.match(name), 63, _1035_MSG
    else:
        ok, limit, msg = re.match(selectors._DNS1123_SUBDOMAIN.pattern, name), 253, _SUBDOMAIN_MSG
    out = []
    if len(name) > limit:
        out.append(bad + f"must be no more than {limit} characters")
    if not ok:
        out.append(bad + msg)
    return out


def _meta_errors(res: Resource, obj: dict) -> list[str]:
    meta = obj.get("metadata") or {}
    out = []
    if not meta.get("name"):
        out.append("metadata.name: Required value: name or generateName is required")
    else:
        out += _name_errors(res.name_rule, meta["name"])
    for k, v in (meta.get("labels") or {}).items():
        why = selectors.validate_label_key(k)
        if why:
            out.append(f'metadata.labels: Invalid value: "{k}": {why}')
        why = selectors.validate_label_value(v) if isinstance(v, str) else "must be a string"
        if why:
            out.append(f'metadata.labels: Invalid value: "{v}": {why}')
    for k in meta.get("annotations") or {}:
        why = selectors.validate_label_key(k)
        if why:
            out.append(f'metadata.annotations: Invalid value: "{k}": {why}')
    for i, ref in enumerate(meta.get("ownerReferences") or []):
        for f in ("apiVersion", "kind", "name", "uid"):
            if not ref.get(f):
                out.append(f"metadata.ownerReferences[{i}].{f}: " + ("Invalid value: \"\": uid must not be empty"
                                                                     if f == "uid" else "Required value"))
    return out


# -- defaulting and validation of the built-in kinds the fake serves ------------------------------


def _image_pull_policy(image: str) -> str:
    tail = image.rsplit("/", 1)[-1]
    if "@" in tail:
        return "IfNotPresent"
    tag = tail.split(":", 1)[1] if ":" in tail else ""
    return "Always" if tag in ("", "latest") else "IfNotPresent"


def _qos(spec: dict) -> str:
    """The pod's QoS class (pkg/apis/core/helper/qos): Guaranteed, Burstable or BestEffort."""
    containers = (spec.get("containers") or []) + (spec.get("initContainers") or [])
    any_set, guaranteed = False, True
    for c in containers:
        res = c.get("resources") or {}
        req, lim = res.get("requests") or {}, res.get("limits") or {}
        if any(k in req or k in lim for k in ("cpu", "memory")):
            any_set = True
        for k in ("cpu", "memory"):
            if k not in lim or str(req.get(k, lim[k])) != str(lim[k]):
                guaranteed = False
    if not any_set:
        return "BestEffort"
    return "Guaranteed" if guaranteed else "Burstable"


def _default_pod(pod: dict, creating: bool) -> None:
    spec = pod.setdefault("spec", {})
    for k, v in (("restartPolicy", "Always"), ("dnsPolicy", "ClusterFirst"), ("schedulerName", "default-scheduler"),
                 ("terminationGracePeriodSeconds", 30), ("securityContext", {}), ("enableServiceLinks", True),
                 ("priority", 0), ("preemptionPolicy", "PreemptLowerPriority")):
        spec.setdefault(k, v)
    if creating:  # admission: the ServiceAccount and DefaultTolerationSeconds plugins
        spec.setdefault("serviceAccountName", spec.get("serviceAccount") or "default")
        spec.setdefault("serviceAccount", spec["serviceAccountName"])
        tolerations = spec.setdefault("tolerations", [])
        for key in ("node.kubernetes.io/not-ready", "node.kubernetes.io/unreachable"):
            if not any(t.get("key") == key and t.get("effect") in (None, "", "NoExecute") for t in tolerations):
                tolerations.append({"key": key, "operator": "Exists", "effect": "NoExecute", "tolerationSeconds": 300})
    for c in (spec.get("containers") or []) + (spec.get("initContainers") or []):
        c.setdefault("terminationMessagePath", "/dev/termination-log")
        c.setdefault("terminationMessagePolicy", "File")
        if c.get("image"):
            c.setdefault("imagePullPolicy", _image_pull_policy(c["image"]))
        res = c.setdefault("resources", {})
        if res.get("limits"):  # requests default to limits (SetDefaults_Pod)
            req = res.setdefault("requests", {})
            for k, v in res["limits"].items():
                req.setdefault(k, v)
        for p in c.get("ports") or []:
            p.setdefault("protocol", "TCP")
        for e in c.get("env") or []:
            ref = (e.get("valueFrom") or {}).get("fieldRef")
            if ref is not None:
                ref.setdefault("apiVersion", "v1")
    if creating:
        st = pod.setdefault("status", {})
        st.setdefault("phase", "Pending")
        st.setdefault("qosClass", _qos(spec))


def _validate_pod(pod: dict) -> list[str]:
    spec = pod.get("spec") or {}
    out = []
    if not spec.get("containers"):
        out.append("spec.containers: Required value")
    names: set[str] = set()
    for kind in ("containers", "initContainers"):
        for i, c in enumerate(spec.get(kind) or []):
            p = f"spec.{kind}[{i}]"
            if not c.get("name"):
                out.append(f"{p}.name: Required value")
            elif not _DNS1123_LABEL.match(c["name"]):
                out.append(f'{p}.name: Invalid value: "{c["name"]}": {_LABEL_MSG}')
            elif c["name"] in names:
                out.append(f'{p}.name: Duplicate value: "{c["name"]}"')
            names.add(c.get("name", ""))
            if not c.get("image"):
                out.append(f"{p}.image: Required value")
    if spec.get("restartPolicy") not in ("Always", "OnFailure", "Never"):
        out.append(f'spec.restartPolicy: Unsupported value: "{spec.get("restartPolicy")}": supported values: '
                   '"Always", "OnFailure", "Never"')
    return out


_POD_MUTABLE = ("activeDeadlineSeconds", "tolerations", "terminationGracePeriodSeconds", "schedulingGates")


def _pod_update_errors(old: dict, new: dict) -> list[str]:
    """Pod specs are immutable but for images and a few fields (ValidatePodUpdate)."""
    def masked(spec: dict) -> dict:
        spec = _copy(spec)
        for kind in ("containers", "initContainers"):
            for c in spec.get(kind) or []:
                c.pop("image", None)
        for k in _POD_MUTABLE:
            spec.pop(k, None)
        return spec
    if masked(old.get("spec") or {}) != masked(new.get("spec") or {}):
        return ["spec: Forbidden: pod updates may not change fields other than `spec.containers[*].image`,"
                "`spec.initContainers[*].image`,`spec.activeDeadlineSeconds`,`spec.tolerations` (only additions to "
                "existing tolerations),`spec.terminationGracePeriodSeconds` (allow it to be set to 1 if it was "
                "previously negative)"]
    return []


def _default_service(svc: dict, old: dict | None, alloc: Callable[[], str], alloc_port: Callable[[], int]) -> None:
    spec = svc.setdefault("spec", {})
    old_spec = (old or {}).get("spec") or {}
    spec.setdefault("type", "ClusterIP")
    spec.setdefault("sessionAffinity", "None")
    for p in spec.get("ports") or []:
        p.setdefault("protocol", "TCP")
        p.setdefault("targetPort", p.get("port"))
    if spec["type"] != "ExternalName":
        for k in ("clusterIP", "clusterIPs"):
            if k not in spec and k in old_spec:
                spec[k] = old_spec[k]  # an update that omits the allocated IP keeps it
        if not spec.get("clusterIP"):
            spec["clusterIP"] = alloc()
        spec.setdefault("clusterIPs", [spec["clusterIP"]])
        spec.setdefault("ipFamilies", ["IPv4"])
        spec.setdefault("ipFamilyPolicy", "SingleStack")
        spec.setdefault("internalTrafficPolicy", "Cluster")
    if spec["type"] in ("NodePort", "LoadBalancer"):
        old_ports = {(p.get("port"), p.get("protocol", "TCP")): p.get("nodePort") for p in old_spec.get("ports") or []}
        for p in spec.get("ports") or []:
            if not p.get("nodePort"):
                p["nodePort"] = old_ports.get((p.get("port"), p["protocol"])) or alloc_port()
        spec.setdefault("externalTrafficPolicy", "Cluster")
    svc.setdefault("status", {"loadBalancer": {}})


def _validate_service(svc: dict) -> list[str]:
    spec = svc.get("spec") or {}
    out = []
    if not spec.get("ports") and spec.get("clusterIP") != "None" and spec.get("type") != "ExternalName":
        out.append("spec.ports: Required value")
    seen: set[str] = set()
    for i, p in enumerate(spec.get("ports") or []):
        if not isinstance(p.get("port"), int) or not 0 < p["port"] < 65536:
            out.append(f"spec.ports[{i}].port: Invalid value: {json.dumps(p.get('port'))}: "
                       "must be between 1 and 65535, inclusive")
        if len(spec.get("ports") or []) > 1 and not p.get("name"):
            out.append(f"spec.ports[{i}].name: Required value")
        if p.get("name") in seen:
            out.append(f'spec.ports[{i}].name: Duplicate value: "{p["name"]}"')
        seen.add(p.get("name"))
    if spec.get("type") not in ("ClusterIP", "NodePort", "LoadBalancer", "ExternalName"):
        out.append(f'spec.type: Unsupported value: "{spec.get("type")}": supported values: "ClusterIP", '
                   '"ExternalName", "LoadBalancer", "NodePort"')
    return out


def _default_secret(sec: dict) -> None:
    sec.setdefault("type", "Opaque")
    string_data = sec.pop("stringData", None) or {}
    if string_data:
        data = sec.setdefault("data", {})
        for k, v in string_data.items():
            data[k] = base64.b64encode(str(v).encode()).decode()


def _validate_secret(sec: dict) -> list[str]:
    out = []
    for k, v in (sec.get("data") or {}).items():
        try:
            base64.b64decode(v, validate=True)
        except (ValueError, TypeError):
            out.append(f"data[{k}]: Invalid value: \"<secret contents redacted>\": illegal base64 data")
    return out


def _default_namespace(ns: dict) -> None:
    ns.setdefault("spec", {}).setdefault("finalizers", ["kubernetes"])
    ns.setdefault("status", {}).setdefault("phase", "Active")
    name = (ns.get("metadata") or {}).get("name")
    if name:
        ns["metadata"].setdefault("labels", {})["kubernetes.io/metadata.name"] = name


# -- patches --------------------------------------------------------------------------------------


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386 JSON merge patch: objects merge, null deletes, anything else replaces."""
    if not isinstance(patch, dict):
        return _copy(patch)
    out = _copy(target) if isinstance(target, dict) else {}
    for k, v in patch.items():
        if v is None:
            out.pop(k, None)
        else:
            out[k] = merge_patch(out.get(k), v)
    return out


# Strategic merge: lists merged by key (the patchMergeKey tags of k8s.io/api/core/v1 types).
_MERGE_KEYS = {"containers": "name", "initContainers": "name", "ephemeralContainers": "name", "env": "name",
               "volumes": "name", "volumeMounts": "mountPath", "volumeDevices": "devicePath",
               "conditions": "type", "ownerReferences": "uid", "imagePullSecrets": "name",
               "hostAliases": "ip", "addresses": "type", "containerStatuses": "name",
               "initContainerStatuses": "name", "topologySpreadConstraints": "topologyKey",
               "resourceClaims": "name", "secrets": "name"}
_MERGE_PRIMITIVES = {"finalizers"}


def strategic_merge_patch(target: Any, patch: Any, field_name: str = "") -> Any:
    """The subset of strategic merge patch the fake needs: keyed list merges, `$patch: delete|replace`."""
    if isinstance(patch, list):
        key = _MERGE_KEYS.get(field_name)
        if field_name == "ports":
            key = "containerPort" if any(isinstance(p, dict) and "containerPort" in p for p in patch) else "port"
        if field_name in _MERGE_PRIMITIVES and isinstance(target, list):
            return list(dict.fromkeys([*target, *patch]))
        if not key or not isinstance(target, list):
            return [x for x in _copy(patch) if not (isinstance(x, dict) and x.get("$patch") == "delete")]
        out = _copy(target)
        for item in patch:
            if not isinstance(item, dict):
                continue
            idx = next((i for i, t in enumerate(out) if isinstance(t, dict) and t.get(key) == item.get(key)), None)
            if item.get("$patch") == "delete":
                if idx is not None:
                    out.pop(idx)
            elif idx is None:
                out.append({k: v for k, v in item.items() if k != "$patch"})
            else:
                out[idx] = strategic_merge_patch(out[idx], item)
        return out
    if not isinstance(patch, dict):
        return _copy(patch)
    if patch.get("$patch") == "replace":
        return {k: v for k, v in _copy(patch).items() if k != "$patch"}
    out = _copy(target) if isinstance(target, dict) else {}
    for k, v in patch.items():
        if k.startswith("$setElementOrder/") or k.startswith("$retainKeys") or k == "$patch":
            continue
        if v is None:
            out.pop(k, None)
        else:
            out[k] = strategic_merge_patch(out.get(k), v, k)
    return out


def _pointer(path: str) -> list[str]:
    if path == "":
        return []
    if not path.startswith("/"):
        raise Invalid(f'the server rejected our request due to an error in our request: JSON pointer "{path}" '
                      "must start with /")
    return [p.replace("~1", "/").replace("~0", "~") for p in path[1:].split("/")]


def _walk_pointer(doc: Any, parts: list[str], path: str) -> tuple[Any, str]:
    cur = doc
    for p in parts[:-1]:
        if isinstance(cur, dict) and p in cur:
            cur = cur[p]
        elif isinstance(cur, list) and p.isdigit() and int(p) < len(cur):
            cur = cur[int(p)]
        else:
            raise Invalid(f"doc is missing path: {path}: missing value")
    return cur, parts[-1]


def json_patch(doc: Any, ops: Any) -> Any:
    """RFC 6902 JSON patch (add, remove, replace, move, copy, test)."""
    if not isinstance(ops, list):
        raise BadRequest("json: cannot unmarshal object into Go value of type jsonpatch.Patch")
    doc = _copy(doc)

    def get(path: str) -> Any:
        parts = _pointer(path)
        if not parts:
            return doc
        parent, last = _walk_pointer(doc, parts, path)
        if isinstance(parent, dict) and last in parent:
            return parent[last]
        if isinstance(parent, list) and last.isdigit() and int(last) < len(parent):
            return parent[int(last)]
        raise Invalid(f"doc is missing path: {path}: missing value")

    def remove(path: str) -> Any:
        parent, last = _walk_pointer(doc, _pointer(path), path)
        if isinstance(parent, dict) and last in parent:
            return parent.pop(last)
        if isinstance(parent, list) and last.isdigit() and int(last) < len(parent):
            return parent.pop(int(last))
        raise Invalid(f"doc is missing path: {path}: missing value")

    def add(path: str, value: Any, replace: bool = False) -> Any:
        nonlocal doc
        parts = _pointer(path)
        if not parts:
            doc = value
            return
        parent, last = _walk_pointer(doc, parts, path)
        if isinstance(parent, dict):
            if replace and last not in parent:
                raise Invalid(f"doc is missing key: {path}: missing value")
            parent[last] = value
        elif isinstance(parent, list):
            if last == "-" and not replace:
                parent.append(value)
            elif last.isdigit() and int(last) <= len(parent) - (1 if replace else 0):
                if replace:
                    parent[int(last)] = value
                else:
                    parent.insert(int(last), value)
            else:
                raise Invalid(f"unable to access invalid index: {last}: invalid index referenced")
        else:
            raise Invalid(f"doc is missing path: {path}: missing value")

    for op in ops:
        kind = op.get("op") if isinstance(op, dict) else None
        path = op.get("path", "") if isinstance(op, dict) else ""
        if kind == "add":
            add(path, _copy(op.get("value")))
        elif kind == "remove":
            remove(path)
        elif kind == "replace":
            add(path, _copy(op.get("value")), replace=True)
        elif kind == "move":
            add(path, remove(op.get("from", "")))
        elif kind == "copy":
            add(path, _copy(get(op.get("from", ""))))
        elif kind == "test":
            if get(path) != op.get("value"):
                raise Invalid(f"testing value {path} failed: test failed")
        else:
            raise BadRequest(f"Unexpected kind: {kind}")
    return doc


def apply_patch(target: dict, patch: Any, patch_type: str) -> dict:
    if patch_type == "json":
        out = json_patch(target, patch)
    elif patch_type == "strategic":
        out = strategic_merge_patch(target, patch)
    elif patch_type == "merge":
        out = merge_patch(target, patch)
    else:
        raise UnsupportedMediaType(f"unknown patch type {patch_type!r}")
    if not isinstance(out, dict):
        raise BadRequest(f"json: cannot unmarshal {type(out).__name__} into Go value of type map[string]interface {{}}")
    return out


# -- the store ------------------------------------------------------------------------------------


@dataclass
class _Event:
    rv: int
    plural: str
    type: str
    obj: dict
    old: dict | None = None


class Subscription:
    """One watch: the events after its start, filtered by namespace and selectors.

    `get(timeout)` returns `(type, object)` (a fresh copy) or None when nothing came in time or the
    watch ended (`closed`). A watch the server ends with an error yields `("ERROR", Status)` last,
    as the wire protocol does (410 Expired from `Store.expire_watches`)."""

    MAX_BACKLOG = 10000  # a watcher this far behind is dropped, as the API server's cacher does

    def __init__(self, store: "Store", plural: str, namespace: str | None, match: Callable[[dict], bool]) -> None:
        self._store = store
        self.plural = plural
        self.namespace = namespace
        self._match = match
        self._queue: collections.deque[tuple[str, dict]] = collections.deque()
        self._cond = threading.Condition()
        self._closed = False
        self._ending = False

    @property
    def closed(self) -> bool:
        with self._cond:
            return self._closed and not self._queue

    def _in_scope(self, obj: dict | None) -> bool:
        if obj is None:
            return False
        if self.namespace and (obj.get("metadata") or {}).get("namespace") != self.namespace:
            return False
        return self._match(obj)

    def _offer(self, ev: _Event) -> None:
        """Translate a store event into what this watcher sees (selector transitions included)."""
        if ev.plural != self.plural:
            return
        now_in = self._in_scope(ev.obj)
        if ev.type == "MODIFIED":
            was_in = self._in_scope(ev.old)
            kind = "MODIFIED" if now_in and was_in else "ADDED" if now_in else "DELETED" if was_in else None
        else:
            kind = ev.type if now_in else None
        if kind:
            self._push(kind, ev.obj)

    def _push(self, kind: str, obj: dict, end: bool = False) -> None:
        with self._cond:
            if self._closed or self._ending:
                return
            self._queue.append((kind, obj))
            if end:
                self._ending = True
                self._closed = True
            elif len(self._queue) > self.MAX_BACKLOG:
                self._closed = True
                self._queue.clear()
            self._cond.notify_all()

    def get(self, timeout: float | None = None) -> tuple[str, dict] | None:
        with self._cond:
            if not self._queue and not self._closed:
                self._cond.wait(timeout)
            if self._queue:
                kind, obj = self._queue.popleft()
                return kind, _copy(obj)
            return None

    def idle(self) -> bool:
        with self._cond:
            return not self._queue

    def close(self) -> None:
        self._store._unsubscribe(self)
        with self._cond:
            self._closed = True
            self._queue.clear()
            self._cond.notify_all()


Hook = Callable[[dict], "dict | None"]


class Store:
    """The cluster's objects, in memory, keyed by (plural, namespace or "", name).

    Thread-safe; every read returns a deep copy and every write stores one, so no caller shares
    mutable state with the store. One resourceVersion counter for everything, as etcd's revision.
    Keeps the last `history` events of each resource type so watches can resume from a
    resourceVersion; older than that is 410 Gone."""

    def __init__(self, history: int = 500) -> None:
        self._lock = threading.RLock()
        self._objs: dict[tuple[str, str, str], dict] = {}
        self._rv = 0
        # One window of events per resource type, as the API server's watch cache keeps.
        self._history_len = history
        self._history: dict[str, collections.deque[_Event]] = {}
        self._compacted: dict[str, int] = {}  # per type: events at or below this resourceVersion are gone
        self._subs: list[Subscription] = []
        self._mutating: dict[str, list[Hook]] = collections.defaultdict(list)
        self._validating: dict[str, list[Hook]] = collections.defaultdict(list)
        self._next_ip = 10
        self._next_node_port = 30000
        for ns in DEFAULT_NAMESPACES:
            self.create("namespaces", {"metadata": {"name": ns}})

    # ---- admission hooks

    def on_create(self, plural: str, fn: Hook, *, validating: bool = False) -> None:
        """Register an admission callback for creates of `plural`.

        Mutating ones (the default) run as mutating webhooks do: after defaulting, before the name is
        generated (so `metadata.name` may be empty and only `generateName` set), in registration
        order; they change the object in place or return a new one. Validating ones run after the
        schema validation, on a copy. Either may raise `Invalid` (or any `ApiError`) to refuse the
        object, as a webhook that denies it."""
        resource(plural)
        (self._validating if validating else self._mutating)[plural].append(fn)

    # ---- reads

    @property
    def resource_version(self) -> str:
        with self._lock:
            return str(self._rv)

    def get(self, plural: str, namespace: str | None, name: str) -> dict | None:
        res = resource(plural)
        with self._lock:
            obj = self._objs.get((plural, (namespace or "default") if res.namespaced else "", name))
            return _copy(obj) if obj is not None else None

    def list(self, plural: str, namespace: str | None, selector: str = "", *,
             field_selector: str = "") -> tuple[list[dict], str]:
        """Objects of `plural` (in `namespace`, or all when None) matching the selectors, by namespace
        and name; and the list's resourceVersion. Raises BadRequest for a bad selector."""
        res = resource(plural)
        match = self._matcher(plural, selector, field_selector)
        with self._lock:
            items = [_copy(o) for (p, ns, _), o in sorted(self._objs.items())
                     if p == plural and (namespace is None or not res.namespaced or ns == namespace) and match(o)]
            return items, str(self._rv)

    @staticmethod
    def _matcher(plural: str, labels: str, fields: str) -> Callable[[dict], bool]:
        try:
            return selectors.selector(labels or "", fields or "", plural)
        except selectors.SelectorError as e:
            raise BadRequest(str(e)) from None

    # ---- writes

    def create(self, plural: str, obj: dict, *, dry_run: bool = False) -> dict:
        """Store a new object as the API server's create does (defaults, admission, generated name,
        uid, creationTimestamp, resourceVersion, validation). Raises Conflict (AlreadyExists),
        Invalid, NotFound (no such namespace), BadRequest."""
        res = resource(plural)
        obj = _copy(obj)
        if not isinstance(obj, dict):
            raise BadRequest("the body of the request was not a JSON object")
        self._check_type(res, obj)
        meta = obj.setdefault("metadata", {})
        if meta.get("resourceVersion"):
            raise ApiError("Internal error occurred: resourceVersion should not be set on objects to be created",
                           {"causes": [{"message": "resourceVersion should not be set on objects to be created"}]})
        if res.namespaced:
            meta["namespace"] = meta.get("namespace") or "default"
            self._check_namespace(meta["namespace"], creating=True)
        else:
            meta.pop("namespace", None)
        self._defaults(res, obj, None)
        for hook in self._mutating.get(plural, ()):
            result = self._run_hook(res, obj, hook)
            if isinstance(result, dict):
                obj = result
        meta = obj.setdefault("metadata", {})
        for k in ("uid", "creationTimestamp", "deletionTimestamp", "deletionGracePeriodSeconds", "resourceVersion"):
            meta.pop(k, None)
        meta["uid"] = str(uuid.uuid4())
        meta["creationTimestamp"] = now_rfc3339()
        if plural in _GENERATION:
            meta["generation"] = 1
        else:
            meta.pop("generation", None)
        with self._lock:
            if not meta.get("name") and meta.get("generateName"):
                meta["name"] = self._generate_name(plural, meta.get("namespace", ""), meta["generateName"])
            errs = _meta_errors(res, obj) + self._validate(res, obj, None)
            if errs:
                raise Invalid(errs, kind=res.kind, group=res.group, name=meta.get("name", ""))
            for hook in self._validating.get(plural, ()):
                self._run_hook(res, _copy(obj), hook)
            if res.namespaced:
                self._check_namespace(meta["namespace"], creating=True)
            key = (plural, meta.get("namespace", ""), meta["name"])
            if key in self._objs:
                raise Conflict(f'{res.qualified} "{meta["name"]}" already exists',
                               self._details(res, meta["name"]), reason="AlreadyExists")
            if dry_run:
                return _copy(obj)
            self._rv += 1
            meta["resourceVersion"] = str(self._rv)
            self._objs[key] = obj
            self._emit(plural, "ADDED", obj)
            return _copy(obj)

    def replace(self, plural: str, obj: dict, *, part: str = "all") -> dict:
        """Replace a stored object (PUT). `part`: "all" writes everything, status included (what the
        in-process controllers use); "main" is the HTTP main resource (status kept, pod specs
        immutable); "status" is the /status subresource (only status changes). A set, stale
        metadata.resourceVersion is a Conflict; an unchanged object is not written (no new
        resourceVersion, no event), as etcd's guaranteed update does."""
        res = resource(plural)
        obj = _copy(obj)
        meta = obj.setdefault("metadata", {})
        ns = (meta.get("namespace") or "default") if res.namespaced else ""
        name = meta.get("name") or ""
        with self._lock:
            cur = self._objs.get((plural, ns, name))
            if cur is None:
                raise NotFound(f'{res.qualified} "{name}" not found', self._details(res, name))
            return self._update(res, cur, obj, part)

    def patch(self, plural: str, namespace: str | None, name: str, patch: Any, patch_type: str = "merge", *,
              part: str = "all") -> dict:
        """Patch a stored object: "merge" (RFC 7386), "json" (RFC 6902) or "strategic" (keyed list
        merges). A resourceVersion in the result is a precondition (Conflict when stale)."""
        res = resource(plural)
        ns = (namespace or "default") if res.namespaced else ""
        with self._lock:
            cur = self._objs.get((plural, ns, name))
            if cur is None:
                raise NotFound(f'{res.qualified} "{name}" not found', self._details(res, name))
            new = apply_patch(cur, patch, patch_type)
            return self._update(res, cur, new, part)

    def delete(self, plural: str, namespace: str | None, name: str, *, propagation: str = "Background",
               preconditions: dict | None = None) -> dict | None:
        """Delete an object; returns its last state (None if there was none). With finalizers it
        only gets a deletionTimestamp (it goes when they are removed). Then its dependents (every
        object whose ownerReferences name its uid) are garbage-collected, transitively:
        "Background" (the default) and "Foreground" delete them, "Orphan" drops the reference."""
        res = resource(plural)
        ns = (namespace or "default") if res.namespaced else ""
        with self._lock:
            cur = self._objs.get((plural, ns, name))
            if cur is None:
                return None
            pre = preconditions or {}
            if pre.get("uid") and pre["uid"] != cur["metadata"]["uid"]:
                raise Conflict(f"Precondition failed: UID in precondition: {pre['uid']}, UID in object meta: "
                               f"{cur['metadata']['uid']}", self._details(res, name))
            if pre.get("resourceVersion") and pre["resourceVersion"] != cur["metadata"]["resourceVersion"]:
                raise Conflict(f"Precondition failed: ResourceVersion in precondition: {pre['resourceVersion']}, "
                               f"ResourceVersion in object meta: {cur['metadata']['resourceVersion']}",
                               self._details(res, name))
            return self._delete(res, cur, propagation)

    # ---- watch

    def watch(self, plural: str, namespace: str | None = None, selector: str = "",
              resource_version: str | None = None, *, field_selector: str = "") -> Subscription:
        """Events of `plural` after `resource_version`. Unset, "" or "0": first a synthetic ADDED for
        every current object (as the real server does), then changes. A version older than the
        kept history raises Gone ("too old resource version")."""
        res = resource(plural)
        match = self._matcher(plural, selector, field_selector)
        with self._lock:
            sub = Subscription(self, plural, namespace if res.namespaced else None, match)
            if resource_version in (None, "", "0"):
                for (p, ns, _), o in sorted(self._objs.items()):
                    if p == plural and sub._in_scope(o):
                        sub._push("ADDED", o)
            else:
                try:
                    n = int(resource_version)
                except ValueError:
                    raise BadRequest(f'resourceVersion: Invalid value: "{resource_version}": '
                                     'strconv.ParseUint: parsing: invalid syntax') from None
                compacted = self._compacted.get(plural, 0)
                if n < compacted:
                    raise Gone(f"too old resource version: {n} ({compacted})")
                for ev in self._history.get(plural, ()):
                    if ev.rv > n:
                        sub._offer(ev)
            self._subs.append(sub)
            return sub

    def compact(self) -> None:
        """Forget the event history (as etcd compaction does): watches from any version before now
        get 410 Gone. Open watches go on."""
        with self._lock:
            self._history.clear()
            self._compacted = dict.fromkeys(RESOURCES, self._rv)

    def expire_watches(self) -> None:
        """End every open watch with an ERROR event carrying 410 Expired (what a client sees when
        its watch outlives the server's history), after compacting."""
        with self._lock:
            self.compact()
            for sub in list(self._subs):
                sub._push("ERROR", Gone(f"too old resource version: {self._rv} ({self._rv})").status(), end=True)
            self._subs.clear()

    def close_watches(self) -> None:
        """End every open watch without an error (server shutdown)."""
        with self._lock:
            subs, self._subs = self._subs, []
        for sub in subs:
            sub.close()

    # ---- internals

    def _unsubscribe(self, sub: Subscription) -> None:
        with self._lock:
            if sub in self._subs:
                self._subs.remove(sub)

    def _emit(self, plural: str, kind: str, obj: dict, old: dict | None = None) -> None:
        history = self._history.setdefault(plural, collections.deque(maxlen=self._history_len))
        if len(history) == history.maxlen:
            self._compacted[plural] = history[0].rv
        ev = _Event(self._rv, plural, kind, obj, old)
        history.append(ev)
        for sub in self._subs:
            sub._offer(ev)
        self._subs = [s for s in self._subs if not s._closed]

    @staticmethod
    def _details(res: Resource, name: str) -> dict:
        d: dict[str, Any] = {"name": name}
        if res.group:
            d["group"] = res.group
        d["kind"] = res.plural
        return d

    @staticmethod
    def _check_type(res: Resource, obj: dict) -> None:
        api_version = obj.setdefault("apiVersion", res.api_version)
        kind = obj.setdefault("kind", res.kind)
        if api_version != res.api_version:
            raise BadRequest(f"the API version in the data ({api_version}) does not match the expected API version "
                             f"({res.api_version})")
        if kind != res.kind:
            raise BadRequest(f"the kind in the data ({kind}) does not match the expected kind ({res.kind})")

    def _check_namespace(self, ns: str, creating: bool) -> None:
        with self._lock:
            nso = self._objs.get(("namespaces", "", ns))
        if nso is None:
            raise NotFound(f'namespaces "{ns}" not found', {"name": ns, "kind": "namespaces"})
        if creating and (nso.get("metadata") or {}).get("deletionTimestamp"):
            raise Forbidden(f"unable to create new content in namespace {ns} because it is being terminated",
                            {"name": ns, "kind": "namespaces",
                             "causes": [{"reason": "NamespaceTerminating", "message": f"namespace {ns} is being "
                                         "terminated", "field": "metadata.namespace"}]})

    def _run_hook(self, res: Resource, obj: dict, hook: Hook) -> Any:
        try:
            return hook(obj)
        except Invalid as e:
            raise e.with_object(res.kind, res.group, (obj.get("metadata") or {}).get("name", "")) from None
        except ApiError:
            raise
        except Exception as e:  # noqa: BLE001 - a webhook that fails (failurePolicy Fail): 500, as the real server
            name = getattr(hook, "__name__", "hook")
            raise ApiError(f'Internal error occurred: failed calling webhook "{name}": {type(e).__name__}: {e}',
                           {"causes": [{"message": f"failed calling webhook \"{name}\": {e}"}]}) from e

    def _generate_name(self, plural: str, ns: str, base: str) -> str:
        base = base[:58]  # maxGeneratedNameLength = 63 - 5
        while True:
            name = base + "".join(random.choice(_NAME_CHARS) for _ in range(5))
            if (plural, ns, name) not in self._objs:
                return name

    def _alloc_ip(self) -> str:
        with self._lock:  # GKE's default service range is 34.118.224.0/20
            ip = str(ipaddress.ip_address("34.118.224.0") + self._next_ip)
            self._next_ip += 1
            return ip

    def _alloc_node_port(self) -> int:
        with self._lock:
            port = self._next_node_port
            self._next_node_port += 1
            return port

    def _defaults(self, res: Resource, obj: dict, old: dict | None) -> None:
        if res.plural == "pods":
            _default_pod(obj, creating=old is None)
        elif res.plural == "services":
            _default_service(obj, old, self._alloc_ip, self._alloc_node_port)
        elif res.plural == "secrets":
            _default_secret(obj)
        elif res.plural == "namespaces":
            _default_namespace(obj)
        elif res.is_crd:
            crd.apply_defaults(obj)

    @staticmethod
    def _validate(res: Resource, obj: dict, old: dict | None) -> list[str]:
        if res.plural == "pods":
            return _validate_pod(obj) + (_pod_update_errors(old, obj) if old is not None else [])
        if res.plural == "services":
            return _validate_service(obj)
        if res.plural == "secrets":
            return _validate_secret(obj)
        if res.is_crd:
            return crd.validate(obj, old)
        return []

    def _update(self, res: Resource, cur: dict, new: dict, part: str) -> dict:
        meta = new.setdefault("metadata", {})
        cmeta = cur["metadata"]
        name = cmeta["name"]
        if meta.get("resourceVersion") and meta["resourceVersion"] != cmeta["resourceVersion"]:
            raise Conflict(f'Operation cannot be fulfilled on {res.qualified} "{name}": the object has been '
                           "modified; please apply your changes to the latest version and try again",
                           self._details(res, name))
        if meta.get("name", name) != name:
            raise BadRequest(f"the name of the object ({meta.get('name')}) does not match the name on the URL ({name})")
        new.setdefault("apiVersion", res.api_version)
        new.setdefault("kind", res.kind)
        self._check_type(res, new)
        if part == "status":  # only .status changes
            new = {**_copy(cur), "status": new.get("status")}
            if new["status"] is None:
                new.pop("status")
        elif part == "main" and res.plural in _STATUS_SPLIT:
            new.pop("status", None)
            if "status" in cur:
                new["status"] = _copy(cur["status"])
        meta = new["metadata"]
        for k in ("uid", "creationTimestamp", "deletionTimestamp", "deletionGracePeriodSeconds", "generation"):
            if k in cmeta:
                meta[k] = cmeta[k]
            else:
                meta.pop(k, None)
        if res.namespaced:
            meta["namespace"] = cmeta["namespace"]
        meta["name"] = name
        meta["resourceVersion"] = cmeta["resourceVersion"]
        if part != "status":
            self._defaults(res, new, cur)
        # Pod specs are immutable over HTTP; in process ("all") the fake kubelet and scheduler bind pods.
        errs = _meta_errors(res, new) + self._validate(res, new, cur if part == "main" or res.is_crd else None)
        if errs:
            raise Invalid(errs, kind=res.kind, group=res.group, name=name)
        if res.plural in _GENERATION:
            spec_of = lambda o: {k: v for k, v in o.items() if k not in ("metadata", "status")}  # noqa: E731
            if spec_of(new) != spec_of(cur):
                meta["generation"] = cmeta.get("generation", 1) + 1
        if new == cur:
            return _copy(cur)
        key = (res.plural, cmeta.get("namespace", ""), name)
        self._rv += 1
        meta["resourceVersion"] = str(self._rv)
        if cmeta.get("deletionTimestamp") and not meta.get("finalizers"):
            del self._objs[key]
            self._emit(res.plural, "DELETED", new)
            self._collect(new, "Background")
            self._finish_namespace(key[1])
            return _copy(new)
        self._objs[key] = new
        self._emit(res.plural, "MODIFIED", new, cur)
        return _copy(new)

    def _delete(self, res: Resource, cur: dict, propagation: str) -> dict:
        key = (res.plural, cur["metadata"].get("namespace", ""), cur["metadata"]["name"])
        if res.plural == "namespaces":
            return self._delete_namespace(cur)
        if propagation == "Foreground":
            self._collect(cur, "Foreground")
        if cur["metadata"].get("finalizers"):
            if cur["metadata"].get("deletionTimestamp"):
                return _copy(cur)
            new = _copy(cur)
            new["metadata"]["deletionTimestamp"] = now_rfc3339()
            new["metadata"]["deletionGracePeriodSeconds"] = 0
            self._rv += 1
            new["metadata"]["resourceVersion"] = str(self._rv)
            self._objs[key] = new
            self._emit(res.plural, "MODIFIED", new, cur)
            if propagation == "Orphan":
                self._collect(new, "Orphan")
            return _copy(new)
        del self._objs[key]
        self._rv += 1
        gone = _copy(cur)
        gone["metadata"]["resourceVersion"] = str(self._rv)
        self._emit(res.plural, "DELETED", gone)
        self._collect(gone, "Orphan" if propagation == "Orphan" else "Background")
        self._finish_namespace(key[1])
        return _copy(gone)

    def _collect(self, owner: dict, propagation: str) -> None:
        """The garbage collector, done at once: dependents of `owner` whose every owner is gone are
        deleted (their own dependents with them); the others, or all with "Orphan", lose the
        reference."""
        uid = owner["metadata"]["uid"]
        live = {o["metadata"]["uid"] for o in self._objs.values()}
        for key, dep in list(self._objs.items()):
            if key not in self._objs:
                continue
            refs = dep["metadata"].get("ownerReferences") or []
            if not any(r.get("uid") == uid for r in refs):
                continue
            others = [r for r in refs if r.get("uid") != uid]
            if propagation == "Orphan" or any(r.get("uid") in live for r in others):
                new = _copy(dep)
                new["metadata"]["ownerReferences"] = others
                if not others:
                    del new["metadata"]["ownerReferences"]
                self._rv += 1
                new["metadata"]["resourceVersion"] = str(self._rv)
                self._objs[key] = new
                self._emit(key[0], "MODIFIED", new, dep)
            else:
                self._delete(RESOURCES[key[0]], dep, "Background" if propagation == "Background" else "Foreground")

    def _delete_namespace(self, cur: dict) -> dict:
        """The namespace controller, done at once: Terminating, its content deleted, then gone (once
        the last object held by a finalizer goes, if any)."""
        name = cur["metadata"]["name"]
        if cur["metadata"].get("deletionTimestamp"):
            return _copy(cur)
        term = _copy(cur)
        term["metadata"].setdefault("deletionTimestamp", now_rfc3339())
        term.setdefault("status", {})["phase"] = "Terminating"
        self._rv += 1
        term["metadata"]["resourceVersion"] = str(self._rv)
        self._objs[("namespaces", "", name)] = term
        self._emit("namespaces", "MODIFIED", term, cur)
        for key in list(self._objs):
            if key[1] == name and key in self._objs and RESOURCES[key[0]].namespaced:
                self._delete(RESOURCES[key[0]], self._objs[key], "Background")
        self._finish_namespace(name)
        return _copy(term)

    def _finish_namespace(self, name: str) -> None:
        ns = self._objs.get(("namespaces", "", name)) if name else None
        if ns is None or not ns["metadata"].get("deletionTimestamp"):
            return
        if any(k[1] == name and RESOURCES[k[0]].namespaced for k in self._objs):
            return
        del self._objs[("namespaces", "", name)]
        self._rv += 1
        gone = _copy(ns)
        gone["metadata"]["resourceVersion"] = str(self._rv)
        self._emit("namespaces", "DELETED", gone)


# -- server-side tables (what kubectl prints) -----------------------------------------------------


def human_duration(seconds: float) -> str:
    """k8s.io/apimachinery/pkg/util/duration.HumanDuration: 45s, 5m30s, 3h, 2d4h, 1y20d."""
    s = int(seconds)
    if s < -1:
        return "<invalid>"
    if s < 0:
        return "0s"
    if s < 120:
        return f"{s}s"
    minutes = s // 60
    if minutes < 10:
        return f"{minutes}m{s % 60}s" if s % 60 else f"{minutes}m"
    if minutes < 180:
        return f"{minutes}m"
    hours = s // 3600
    if hours < 8:
        return f"{hours}h{minutes % 60}m" if minutes % 60 else f"{hours}h"
    if hours < 48:
        return f"{hours}h"
    if hours < 24 * 8:
        return f"{hours // 24}d{hours % 24}h" if hours % 24 else f"{hours // 24}d"
    if hours < 24 * 365 * 2:
        return f"{hours // 24}d"
    if hours < 24 * 365 * 8:
        days = (hours // 24) % 365
        return f"{hours // 24 // 365}y{days}d" if days else f"{hours // 24 // 365}y"
    return f"{hours // 24 // 365}y"


def _since(ts: Any) -> str:
    """A timestamp cell as the server renders it (ConvertToHumanReadableDateType): an age like "5m"."""
    if not ts:
        return "<unknown>"
    try:
        created = dt.datetime.strptime(str(ts), "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=dt.timezone.utc)
    except ValueError:
        return "<invalid>"
    return human_duration((dt.datetime.now(dt.timezone.utc) - created).total_seconds())


def _age(obj: dict) -> str:
    return _since((obj.get("metadata") or {}).get("creationTimestamp"))


def _pod_cells(p: dict) -> list:
    """printPod (pkg/printers/internalversion/printers.go), without the sidecar and restart-age details."""
    spec, st = p.get("spec") or {}, p.get("status") or {}
    reason = st.get("reason") or st.get("phase") or ""
    restarts, ready, initializing = 0, 0, False
    inits = spec.get("initContainers") or []
    for i, c in enumerate(st.get("initContainerStatuses") or []):
        restarts += c.get("restartCount", 0)
        state = c.get("state") or {}
        term, wait = state.get("terminated"), state.get("waiting")
        if term and term.get("exitCode") == 0:
            continue
        initializing = True
        if term:
            reason = "Init:" + (term.get("reason") or (f"Signal:{term['signal']}" if term.get("signal")
                                                       else f"ExitCode:{term.get('exitCode')}"))
        elif wait and wait.get("reason") and wait["reason"] != "PodInitializing":
            reason = "Init:" + wait["reason"]
        else:
            reason = f"Init:{i}/{len(inits)}"
        break
    if not initializing:
        restarts, running = 0, False
        for c in reversed(st.get("containerStatuses") or []):
            restarts += c.get("restartCount", 0)
            state = c.get("state") or {}
            term, wait = state.get("terminated"), state.get("waiting")
            if wait and wait.get("reason"):
                reason = wait["reason"]
            elif term and term.get("reason"):
                reason = term["reason"]
            elif term:
                reason = f"Signal:{term['signal']}" if term.get("signal") else f"ExitCode:{term.get('exitCode')}"
            elif c.get("ready") and "running" in state:
                running = True
                ready += 1
        if reason == "Completed" and running:
            reason = "Running"
    if (p.get("metadata") or {}).get("deletionTimestamp"):
        reason = "Unknown" if st.get("reason") == "NodeLost" else "Terminating"
    gates = spec.get("readinessGates") or []
    return [p["metadata"]["name"], f"{ready}/{len(spec.get('containers') or [])}", reason, str(restarts), _age(p),
            st.get("podIP") or "<none>", spec.get("nodeName") or "<none>", st.get("nominatedNodeName") or "<none>",
            f"0/{len(gates)}" if gates else "<none>"]


def _node_cells(n: dict) -> list:
    st, spec = n.get("status") or {}, n.get("spec") or {}
    ready = next((c.get("status") for c in st.get("conditions") or [] if c.get("type") == "Ready"), None)
    status = {"True": "Ready", "False": "NotReady"}.get(ready or "", "Unknown")
    if spec.get("unschedulable"):
        status += ",SchedulingDisabled"
    labels = (n.get("metadata") or {}).get("labels") or {}
    roles = sorted({k.split("/", 1)[1] for k in labels if k.startswith("node-role.kubernetes.io/") and "/" in k}
                   | ({labels["kubernetes.io/role"]} if labels.get("kubernetes.io/role") else set()))
    info = st.get("nodeInfo") or {}
    addr = {a.get("type"): a.get("address") for a in st.get("addresses") or []}
    return [n["metadata"]["name"], status, ",".join(roles) or "<none>", _age(n), info.get("kubeletVersion", ""),
            addr.get("InternalIP", "<none>"), addr.get("ExternalIP", "<none>"), info.get("osImage", "<unknown>"),
            info.get("kernelVersion", "<unknown>"), info.get("containerRuntimeVersion", "<unknown>")]


def _service_cells(s: dict) -> list:
    spec = s.get("spec") or {}
    ports = ",".join(f"{p.get('port')}{':' + str(p['nodePort']) if p.get('nodePort') else ''}/{p.get('protocol', 'TCP')}"
                     for p in spec.get("ports") or []) or "<none>"
    ingress = ((s.get("status") or {}).get("loadBalancer") or {}).get("ingress") or []
    external = ",".join(i.get("ip") or i.get("hostname", "") for i in ingress) or (
        "<pending>" if spec.get("type") == "LoadBalancer" else "<none>")
    selector = ",".join(f"{k}={v}" for k, v in sorted((spec.get("selector") or {}).items())) or "<none>"
    return [s["metadata"]["name"], spec.get("type", ""), spec.get("clusterIP") or "<none>", external, ports, _age(s),
            selector]


def _col(name: str, type_: str = "string", priority: int = 0, description: str = "", fmt: str = "") -> dict:
    return {"name": name, "type": type_, "format": fmt, "description": description, "priority": priority}


_NAME_COL = _col("Name", fmt="name", description="Name must be unique within a namespace. Is required when creating "
                 "resources, although some resources may allow a client to request the generation of an appropriate "
                 "name automatically. Name is primarily intended for creation idempotence and configuration "
                 "definition. Cannot be updated.")
_AGE_DESC = "CreationTimestamp is a timestamp representing the server time when this object was created."
_TABLES: dict[str, tuple[list[dict], Callable[[dict], list]]] = {
    "pods": ([_NAME_COL, _col("Ready", description="The aggregate readiness state of this pod for accepting traffic."),
              _col("Status", description="The aggregate status of the containers in this pod."),
              _col("Restarts", description="The number of times the containers in this pod have been restarted and "
                   "when the last container in this pod has restarted."),
              _col("Age", description=_AGE_DESC), _col("IP", priority=1, description="IP address allocated to the pod."),
              _col("Node", priority=1, description="Name of the Node this pod is assigned to."),
              _col("Nominated Node", priority=1, description="Name of the Node that this pod is nominated to."),
              _col("Readiness Gates", priority=1, description="The readiness gates of this pod.")], _pod_cells),
    "nodes": ([_NAME_COL, _col("Status", description="The status of the node"),
               _col("Roles", description="The roles of the node"), _col("Age", description=_AGE_DESC),
               _col("Version", description="Kubelet Version reported by the node."),
               _col("Internal-IP", priority=1, description="List of addresses reachable to the node."),
               _col("External-IP", priority=1, description="List of addresses reachable to the node."),
               _col("OS-Image", priority=1, description="OS Image reported by the node from /etc/os-release."),
               _col("Kernel-Version", priority=1, description="Kernel Version reported by the node."),
               _col("Container-Runtime", priority=1, description="Container Runtime Version reported by the node.")],
              _node_cells),
    "services": ([_NAME_COL, _col("Type", description="The type of the service."),
                  _col("Cluster-IP", description="The IP address of the service."),
                  _col("External-IP", description="The external IP address of the service."),
                  _col("Port(s)", description="The ports of the service."), _col("Age", description=_AGE_DESC),
                  _col("Selector", priority=1, description="The selector of the service.")], _service_cells),
    "namespaces": ([_NAME_COL, _col("Status", description="The status of the namespace"),
                    _col("Age", description=_AGE_DESC)],
                   lambda o: [o["metadata"]["name"], (o.get("status") or {}).get("phase", ""), _age(o)]),
}


def _table_shape(res: Resource) -> tuple[list[dict], Callable[[dict], list]]:
    if res.plural in _TABLES:
        return _TABLES[res.plural]
    if res.is_crd:  # the CRD's additionalPrinterColumns after Name; dates stay timestamps (kubectl ages them)
        cols = crd.printer_columns()
        defs = [_NAME_COL] + [_col(c["name"], c["type"], c.get("priority", 0), c.get("description", ""),
                                   c.get("format", "")) for c in cols]
        def cell(o: dict, c: dict) -> Any:
            v = crd.json_path(o, c["jsonPath"])
            return _since(v) if c["type"] == "date" and v is not None else v
        return defs, lambda o: [o["metadata"]["name"]] + [cell(o, c) for c in cols]
    # the default table convertor: Name and Created At
    return ([_NAME_COL, _col("Created At", "date", description=_AGE_DESC)], lambda o: [o["metadata"]["name"], _age(o)])


def table(res: Resource, objs: list[dict], list_meta: dict, include: str = "PartialObjectMetadata",
          headers: bool = True) -> dict:
    """A meta.k8s.io/v1 Table of `objs`, with each row's object as `includeObject` asks."""
    defs, cells = _table_shape(res)
    rows = []
    for o in objs:
        row: dict[str, Any] = {"cells": cells(o)}
        if include == "Object":
            row["object"] = {"apiVersion": res.api_version, "kind": res.kind, **o}
        elif include != "None":
            row["object"] = {"kind": "PartialObjectMetadata", "apiVersion": "meta.k8s.io/v1",
                             "metadata": o.get("metadata") or {}}
        rows.append(row)
    return {"kind": "Table", "apiVersion": "meta.k8s.io/v1", "metadata": list_meta,
            "columnDefinitions": defs if headers else [], "rows": rows}


# -- WebSocket (RFC 6455), for port-forward ---------------------------------------------------------

_WS_GUID = "258EAFA5-E914-47DA-95CA-C5AB0DC85B11"
# What kubelet's port-forward accepts (pkg/kubelet/cri/streaming/portforward/websocket.go); the first
# one the client offers wins. Not v5.channel.k8s.io: that is exec/attach's.
_PF_PROTOCOLS = ("v4.channel.k8s.io", "v4.base64.channel.k8s.io", "channel.k8s.io", "base64.channel.k8s.io")
OP_CONT, OP_TEXT, OP_BINARY, OP_CLOSE, OP_PING, OP_PONG = 0x0, 0x1, 0x2, 0x8, 0x9, 0xA


def ws_accept_key(key: str) -> str:
    return base64.b64encode(hashlib.sha1((key + _WS_GUID).encode()).digest()).decode()


def ws_frame(payload: bytes, opcode: int = OP_BINARY, mask: bool = False) -> bytes:
    """One final frame. Servers never mask; clients always do (the tests' own client uses mask=True)."""
    n = len(payload)
    head = bytes([0x80 | opcode])
    mbit = 0x80 if mask else 0
    if n < 126:
        head += bytes([mbit | n])
    elif n < 1 << 16:
        head += bytes([mbit | 126]) + struct.pack("!H", n)
    else:
        head += bytes([mbit | 127]) + struct.pack("!Q", n)
    if not mask:
        return head + payload
    key = os.urandom(4)
    return head + key + _unmask(payload, key)


def _unmask(data: bytes, key: bytes) -> bytes:
    n = len(data)
    if not n:
        return b""
    pad = (key * (n // 4 + 1))[:n]
    return (int.from_bytes(data, "big") ^ int.from_bytes(pad, "big")).to_bytes(n, "big")


class WsReader:
    """Incremental frame parser: feed it bytes, take whole messages (fragments joined) and control frames."""

    def __init__(self) -> None:
        self.buf = bytearray()
        self._frag_op: int | None = None
        self._frag = bytearray()

    def feed(self, data: bytes) -> list[tuple[int, bytes]]:
        self.buf += data
        out = []
        while True:
            if len(self.buf) < 2:
                return out
            b0, b1 = self.buf[0], self.buf[1]
            fin, op, masked, n = b0 & 0x80, b0 & 0x0F, b1 & 0x80, b1 & 0x7F
            pos = 2
            if n == 126:
                if len(self.buf) < 4:
                    return out
                n, pos = struct.unpack("!H", self.buf[2:4])[0], 4
            elif n == 127:
                if len(self.buf) < 10:
                    return out
                n, pos = struct.unpack("!Q", self.buf[2:10])[0], 10
            key = b""
            if masked:
                if len(self.buf) < pos + 4:
                    return out
                key, pos = bytes(self.buf[pos:pos + 4]), pos + 4
            if len(self.buf) < pos + n:
                return out
            payload = bytes(self.buf[pos:pos + n])
            del self.buf[:pos + n]
            if key:
                payload = _unmask(payload, key)
            if op >= 0x8:  # control frames may come between fragments
                out.append((op, payload))
            elif op == OP_CONT:
                self._frag += payload
                if fin and self._frag_op is not None:
                    out.append((self._frag_op, bytes(self._frag)))
                    self._frag_op, self._frag = None, bytearray()
            elif fin:
                out.append((op, payload))
            else:
                self._frag_op, self._frag = op, bytearray(payload)


# -- the HTTP server --------------------------------------------------------------------------------

_RETURNS_DELETED = {"pods", "serviceaccounts", "namespaces"}  # registries with ReturnDeletedObject; others answer a Status
_PATCH_TYPES = {"application/merge-patch+json": "merge", "application/json-patch+json": "json",
                "application/strategic-merge-patch+json": "strategic"}


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    block_on_close = False
    allow_reuse_address = True

    def __init__(self, addr: tuple[str, int], api: "ApiServer", ctx: ssl.SSLContext) -> None:
        self.api, self.ctx = api, ctx
        super().__init__(addr, _Handler)

    def get_request(self) -> tuple[socket.socket, Any]:
        sock, addr = self.socket.accept()
        # The TLS handshake happens in the request's thread (setup), so a slow client blocks no one.
        return self.ctx.wrap_socket(sock, server_side=True, do_handshake_on_connect=False), addr


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _Server

    def setup(self) -> None:
        self._tls_ok = True
        try:
            self.request.settimeout(10)
            self.request.do_handshake()
            self.request.settimeout(None)
        except (ssl.SSLError, OSError):
            self._tls_ok = False
        super().setup()
        self.server.api._conns.add(self.request)

    def finish(self) -> None:
        self.server.api._conns.discard(self.request)
        try:
            super().finish()
        except (OSError, ssl.SSLError):
            pass

    def handle(self) -> None:
        if self._tls_ok:
            try:
                super().handle()
            except (OSError, ssl.SSLError):
                pass

    def _serve(self) -> None:
        self.server.api._dispatch(self)

    do_GET = do_POST = do_PUT = do_PATCH = do_DELETE = _serve

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - stdlib signature
        pass


@dataclass
class _Req:
    h: _Handler
    method: str
    path: str
    query: dict[str, list[str]]
    body: bytes
    user: str = ""
    headers_sent: bool = False

    def q(self, key: str, default: str = "") -> str:
        return (self.query.get(key) or [default])[0]


class ApiServer:
    """The Store served over HTTPS, as kube-apiserver serves it to the python client and kubectl.

    `tokens` maps bearer tokens to user names; a request without a known one is 401. `deny()`
    makes a user's requests 403 with RBAC's message; `set_served("ray.io/v1", False)` makes a
    group-version disappear (KubeRay's CRD not installed). `watch_gone` is how a watch from a
    too-old resourceVersion fails: "event" (what kube-apiserver's watch cache does: HTTP 200, then an
    ERROR event with a 410 Expired Status) or "http" (an HTTP 410 Status at once), so a client can be
    tested against both. A watch already running fails the first way (`Store.expire_watches`)."""

    def __init__(self, store: Store, tokens: dict[str, str], *, host: str = "127.0.0.1", port: int = 0,
                 extra_ips: Iterable[str] = (), version: str = "v1.32.4-gke.1106006", watch_gone: str = "event",
                 bookmark_interval: float = 60.0, watch_timeout: float = 1800.0) -> None:
        if watch_gone not in ("event", "http"):
            raise ValueError("watch_gone is 'event' or 'http'")
        self.store = store
        self.tokens = dict(tokens)
        self.host, self.port = host, port
        self.version = version
        self.watch_gone = watch_gone
        self.bookmark_interval = bookmark_interval
        self.watch_timeout = watch_timeout
        extra = [*extra_ips] + ([host] if host not in ("", "0.0.0.0", "::", "localhost") else [])
        self.pki = make_pki(ips=extra)
        self.requests: list[tuple[str, str, str]] = []  # (method, path?query, user), for assertions
        self._denied: set[tuple[str, str, str, str | None]] = set()
        self._unserved: set[str] = set()
        self._conns: set[socket.socket] = set()
        self._stopping = threading.Event()
        self._httpd: _Server | None = None
        self._thread: threading.Thread | None = None

    # ---- lifecycle and files

    def start(self) -> str:
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        with tempfile.TemporaryDirectory() as d:
            cert, key = Path(d, "tls.crt"), Path(d, "tls.key")
            cert.write_bytes(self.pki.cert_pem + self.pki.ca_pem)
            key.write_bytes(self.pki.key_pem)
            ctx.load_cert_chain(cert, key)
        self._httpd = _Server((self.host, self.port), self, ctx)
        self.port = self._httpd.server_address[1]
        self._thread = threading.Thread(target=self._httpd.serve_forever, kwargs={"poll_interval": 0.1},
                                        name=f"fake-apiserver:{self.port}", daemon=True)
        self._thread.start()
        return self.url

    def stop(self) -> None:
        self._stopping.set()
        self.store.close_watches()
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()
        for conn in list(self._conns):
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        if self._thread is not None:
            self._thread.join(timeout=5)

    def __enter__(self) -> "ApiServer":
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def url(self) -> str:
        host = "127.0.0.1" if self.host in ("", "0.0.0.0", "::") else self.host
        return f"https://{host}:{self.port}"

    @property
    def ca_pem(self) -> str:
        return self.pki.ca_pem.decode()

    def token_for(self, user: str) -> str:
        for token, name in self.tokens.items():
            if name == user:
                return token
        raise KeyError(f"no token for user {user!r}")

    def kubeconfig(self, path: str | os.PathLike, user: str = "admin", namespace: str = "default",
                   token: str | None = None) -> Path:
        """Write a kubeconfig (context "fake": this server, its CA, `user` with `token`, by default the
        token `tokens` gives that user)."""
        cfg = {
            "apiVersion": "v1", "kind": "Config", "preferences": {},
            "clusters": [{"name": "fake", "cluster": {
                "server": self.url, "certificate-authority-data": base64.b64encode(self.pki.ca_pem).decode()}}],
            "users": [{"name": user, "user": {"token": token or self.token_for(user)}}],
            "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": user, "namespace": namespace}}],
            "current-context": "fake",
        }
        p = Path(path)
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(json.dumps(cfg, indent=2) + "\n")
        return p

    def serviceaccount_dir(self, path: str | os.PathLike, token: str, namespace: str = "default") -> Path:
        """Write what a pod's /var/run/secrets/kubernetes.io/serviceaccount holds: token (no trailing
        newline: the python client sends the file as is), ca.crt, namespace."""
        p = Path(path)
        p.mkdir(parents=True, exist_ok=True)
        (p / "token").write_text(token)
        (p / "ca.crt").write_bytes(self.pki.ca_pem)
        (p / "namespace").write_text(namespace)
        return p

    def service_env(self) -> dict[str, str]:
        """KUBERNETES_SERVICE_HOST/PORT, as the kubelet sets them in every pod (for load_incluster_config)."""
        host = self.url.split("://", 1)[1].rsplit(":", 1)[0]
        return {"KUBERNETES_SERVICE_HOST": host, "KUBERNETES_SERVICE_PORT": str(self.port)}

    # ---- RBAC stand-in and served APIs

    def deny(self, user: str, verb: str, resource: str, namespace: str | None = None) -> None:
        """Refuse `user` `verb` on `resource` ("pods", "pods/portforward", "rayclusters"; "*" for any of
        user, verb, resource) in `namespace` (None: everywhere, cluster scope included)."""
        self._denied.add((user, verb, resource, namespace))

    def allow(self, user: str, verb: str, resource: str, namespace: str | None = None) -> None:
        """Undo a `deny` with the same arguments."""
        self._denied.discard((user, verb, resource, namespace))

    def set_served(self, group_version: str, served: bool = True) -> None:
        """Serve or stop serving a group-version ("ray.io/v1"): unserved, its paths are 404 and it is
        absent from discovery, as when its CRD is not installed."""
        if served:
            self._unserved.discard(group_version)
        else:
            self._unserved.add(group_version)

    def _served(self) -> dict[str, dict[str, Resource]]:
        out: dict[str, dict[str, Resource]] = {}
        for r in [*RESOURCES.values(), SSAR]:
            gv = r.api_version
            if gv not in self._unserved:
                out.setdefault(gv, {})[r.plural] = r
        return out

    def _denies(self, user: str, verb: str, resource: str, ns: str | None) -> bool:
        return any(u in (user, "*") and v in (verb, "*") and r in (resource, "*") and (n is None or n == ns)
                   for u, v, r, n in self._denied)

    def _rbac_allows(self, user: str, verb: str, res: Resource, full: str, ns: str | None) -> bool:
        """Kubernetes RBAC for a service account (`system:serviceaccount:<ns>:<name>`): allowed only by a
        RoleBinding in `ns` or a ClusterRoleBinding naming it, whose (Cluster)Role has a rule for the
        group, resource and verb. Other users (the kubeconfig's) are the cluster's admins here."""
        if not user.startswith("system:serviceaccount:"):
            return True
        _, _, sa_ns, sa = user.split(":", 3)

        def names_me(b: dict) -> bool:
            return any(x.get("kind") == "ServiceAccount" and x.get("name") == sa and x.get("namespace", sa_ns) == sa_ns
                       for x in b.get("subjects") or [])

        def grants(role: dict | None) -> bool:
            for r in (role or {}).get("rules") or []:
                if (res.group in r.get("apiGroups", []) or "*" in r.get("apiGroups", [])) and \
                        (full in r.get("resources", []) or "*" in r.get("resources", [])) and \
                        (verb in r.get("verbs", []) or "*" in r.get("verbs", [])):
                    return True
            return False

        bindings = [(b, ns) for b in self.store.list("rolebindings", ns)[0]] if ns else []
        bindings += [(b, None) for b in self.store.list("clusterrolebindings", None)[0]]
        for b, b_ns in bindings:
            if not names_me(b):
                continue
            ref = b.get("roleRef") or {}
            role = (self.store.get("roles", b_ns, ref.get("name", "")) if ref.get("kind") == "Role" and b_ns
                    else self.store.get("clusterroles", "", ref.get("name", "")))
            if grants(role):
                return True
        return False

    def _authorize(self, user: str, verb: str, res: Resource, sub: str | None, ns: str | None, name: str | None) -> None:
        full = f"{res.plural}/{sub}" if sub else res.plural
        if self._denies(user, verb, full, ns) or not self._rbac_allows(user, verb, res, full, ns):
                where = f'in the namespace "{ns}"' if ns else "at the cluster scope"
                why = f'User "{user}" cannot {verb} resource "{full}" in API group "{res.group}" {where}'
                qualified = f"{res.plural}.{res.group}" if res.group else res.plural
                msg = f'{qualified} "{name}" is forbidden: {why}' if name else f"{qualified} is forbidden: {why}"
                details: dict[str, Any] = {}
                if name:
                    details["name"] = name
                if res.group:
                    details["group"] = res.group
                details["kind"] = res.plural
                raise Forbidden(msg, details)

    # ---- request handling

    def _dispatch(self, h: _Handler) -> None:
        url = urlsplit(h.path)
        length = int(h.headers.get("Content-Length") or 0)
        body = h.rfile.read(length) if length else b""
        req = _Req(h, h.command, url.path, parse_qs(url.query, keep_blank_values=True), body)
        try:
            req.user = self._authenticate(h)
            self.requests.append((h.command, h.path, req.user))
            self._route(req)
        except ApiError as e:
            e = self._strict_decoding(req, e)
            if req.headers_sent:
                h.close_connection = True
            else:
                self._send(req, e.code, e.status())
        except (BrokenPipeError, ConnectionResetError, ssl.SSLError):
            h.close_connection = True
        except Exception as e:  # noqa: BLE001 - a bug in the fake is a 500, as a server's would be
            if not req.headers_sent:
                self._send(req, 500, status_doc(500, "InternalError", f"fake apiserver: {type(e).__name__}: {e}"))
            raise

    @staticmethod
    def _strict_decoding(req: _Req, e: ApiError) -> ApiError:
        """Unknown fields under `fieldValidation=Strict` (what kubectl 1.27+ sends) fail decoding, before
        validation: 400 "strict decoding error", as the real server answers. Without it the fake still
        refuses them, as 422 causes (a real server would drop them, with a warning)."""
        if req.q("fieldValidation") != "Strict" or not isinstance(e, Invalid):
            return e
        unknown = [m.rsplit(": unknown field", 1)[0] for m in e.messages if m.endswith(": unknown field")]
        if not unknown:
            return e
        return BadRequest("strict decoding error: " + ", ".join(f'unknown field "{f}"' for f in unknown))

    def _authenticate(self, h: _Handler) -> str:
        auth = h.headers.get("Authorization") or ""
        scheme, _, token = auth.partition(" ")
        if scheme.lower() == "bearer" and token.strip() in self.tokens:
            return self.tokens[token.strip()]
        raise Unauthorized("Unauthorized")

    def _send(self, req: _Req, code: int, doc: Any, content_type: str = "application/json") -> None:
        body = doc if isinstance(doc, bytes) else json.dumps(doc).encode()
        h = req.h
        h.send_response(code)
        h.send_header("Content-Type", content_type)
        h.send_header("Content-Length", str(len(body)))
        h.send_header("Cache-Control", "no-cache, private")
        h.end_headers()
        req.headers_sent = True
        h.wfile.write(body)

    def _route(self, req: _Req) -> None:
        path = req.path.rstrip("/") or "/"
        if path in ("/healthz", "/livez", "/readyz"):
            return self._send(req, 200, b"ok", "text/plain; charset=utf-8")
        if req.method != "GET" and path in ("/version", "/api", "/apis", "/"):
            raise MethodNotAllowed("the server does not allow this method on the requested resource", {})
        served = self._served()
        if path == "/version":
            return self._send(req, 200, self._version())
        if path in ("/openapi/v2", "/swagger-2.0.0.pb-v1"):
            return self._openapi_v2(req)
        if path == "/api":
            return self._send(req, 200, {"kind": "APIVersions", "versions": ["v1"] if "v1" in served else [],
                                         "serverAddressByClientCIDRs": [{"clientCIDR": "0.0.0.0/0",
                                                                          "serverAddress": f"{self.host}:{self.port}"}]})
        groups = self._groups(served)
        if path == "/apis":
            return self._send(req, 200, {"kind": "APIGroupList", "apiVersion": "v1", "groups": list(groups.values())})
        parts = path.strip("/").split("/")
        if parts[0] == "api" and len(parts) >= 2:
            gv, rest = parts[1], parts[2:]
        elif parts[0] == "apis" and len(parts) == 2 and parts[1] in groups and req.method == "GET":
            return self._send(req, 200, {"kind": "APIGroup", "apiVersion": "v1", **groups[parts[1]]})
        elif parts[0] == "apis" and len(parts) >= 3:
            gv, rest = f"{parts[1]}/{parts[2]}", parts[3:]
        else:
            raise NotFound("the server could not find the requested resource", {})
        if gv not in served:
            raise NotFound("the server could not find the requested resource", {})
        resources = served[gv]
        if not rest:
            if req.method != "GET":
                raise MethodNotAllowed("the server does not allow this method on the requested resource", {})
            return self._send(req, 200, self._resource_list(gv, resources))
        ns = None
        if rest[0] == "namespaces" and len(rest) >= 3 and rest[2] in resources and resources[rest[2]].namespaced:
            ns, rest = rest[1], rest[2:]
        res = resources.get(rest[0])
        if res is None or len(rest) > 3 or (res.namespaced and ns is None and len(rest) > 1):
            raise NotFound("the server could not find the requested resource", {})
        name = rest[1] if len(rest) > 1 else None
        sub = rest[2] if len(rest) > 2 else None
        if sub is not None and sub not in res.subresources:
            raise NotFound("the server could not find the requested resource", {})
        if res is SSAR:
            if req.method != "POST" or name:
                raise MethodNotAllowed("the server does not allow this method on the requested resource", {})
            return self._access_review(req)
        verb = self._verb(req, name, sub)
        if sub == "portforward":
            self._authorize(req.user, "get", res, sub, ns, name)
        self._authorize(req.user, verb, res, sub, ns, name)
        if sub == "portforward":
            return self._portforward(req, ns or "default", name or "")
        if sub == "binding":
            return self._binding(req, ns or "default", name or "")
        handler = {"list": self._list, "watch": self._watch, "get": self._get, "create": self._create,
                   "update": self._update, "patch": self._patch, "delete": self._delete,
                   "deletecollection": self._deletecollection}[verb]
        handler(req, res, ns, name, sub)

    def _verb(self, req: _Req, name: str | None, sub: str | None) -> str:
        m = req.method
        if sub in ("portforward", "binding"):
            return "create"
        if m == "GET":
            if name:
                return "get"
            return "watch" if req.q("watch").lower() in ("true", "1") else "list"
        if m == "POST" and not name:
            return "create"
        if m == "PUT" and name:
            return "update"
        if m == "PATCH" and name:
            return "patch"
        if m == "DELETE":
            return "delete" if name else "deletecollection"
        raise MethodNotAllowed("the server does not allow this method on the requested resource", {})

    # ---- discovery

    def _version(self) -> dict:
        m = re.match(r"v(\d+)\.(\d+)", self.version)
        major, minor = (m.group(1), m.group(2)) if m else ("1", "32")
        return {"major": major, "minor": minor, "emulationMajor": major, "emulationMinor": minor,
                "minCompatibilityMajor": major, "minCompatibilityMinor": str(max(int(minor) - 1, 0)),
                "gitVersion": self.version, "gitCommit": hashlib.sha1(self.version.encode()).hexdigest(),
                "gitTreeState": "clean", "buildDate": "2025-05-01T00:00:00Z", "goVersion": "go1.23.8 X:boringcrypto",
                "compiler": "gc", "platform": "linux/amd64"}

    def _openapi_v2(self, req: _Req) -> None:
        """An OpenAPI v2 document with no definitions. kubectl create/apply download one before
        sending (kubectl 1.20 asks for protobuf and gives up on a 404); finding no schema for a kind,
        kubectl skips its client-side validation and leaves it to the server, as it does for a CRD
        without one. The fake validates server-side (RayCluster's schema, pods, services)."""
        title, version = b"Kubernetes", self.version.encode()
        if "protobuf" in (req.h.headers.get("Accept") or ""):
            info = b"\x0a" + bytes([len(title)]) + title + b"\x12" + bytes([len(version)]) + version
            doc = b"\x0a\x032.0" + b"\x12" + bytes([len(info)]) + info + b"\x42\x00\x4a\x00"  # gnostic Document
            return self._send(req, 200, doc, "application/com.github.proto-openapi.spec.v2.v1.0+protobuf")
        self._send(req, 200, {"swagger": "2.0", "info": {"title": "Kubernetes", "version": self.version},
                              "paths": {}, "definitions": {}})

    def _access_review(self, req: _Req) -> None:
        """POST selfsubjectaccessreviews (`kubectl auth can-i`): what `deny` says about the caller."""
        body = self._body(req)
        spec = body.get("spec") or {}
        attrs = spec.get("resourceAttributes") or {}
        full = attrs.get("resource", "") + (f"/{attrs['subresource']}" if attrs.get("subresource") else "")
        allowed = not (attrs and self._denies(req.user, attrs.get("verb", ""), full, attrs.get("namespace") or None))
        self._send(req, 201, {"kind": "SelfSubjectAccessReview", "apiVersion": "authorization.k8s.io/v1",
                              "metadata": {"creationTimestamp": None}, "spec": spec, "status": {"allowed": allowed}})

    @staticmethod
    def _groups(served: dict[str, dict[str, Resource]]) -> dict[str, dict]:
        groups: dict[str, dict] = {}
        for gv in served:
            if "/" not in gv:
                continue
            group, version = gv.split("/", 1)
            entry = {"groupVersion": gv, "version": version}
            g = groups.setdefault(group, {"name": group, "versions": [], "preferredVersion": entry})
            g["versions"].append(entry)
        return groups

    @staticmethod
    def _resource_list(gv: str, resources: dict[str, Resource]) -> dict:
        out = []
        for r in resources.values():
            entry: dict[str, Any] = {"name": r.plural, "singularName": r.singular, "namespaced": r.namespaced,
                                     "kind": r.kind, "verbs": list(r.verbs)}
            if r.short_names:
                entry["shortNames"] = list(r.short_names)
            if r.categories:
                entry["categories"] = list(r.categories)
            out.append(entry)
            for sub in r.subresources:
                kind = {"portforward": "PodPortForwardOptions", "binding": "Binding"}.get(sub, r.kind)
                verbs = {"portforward": ["create", "get"], "binding": ["create"]}.get(sub, ["get", "patch", "update"])
                out.append({"name": f"{r.plural}/{sub}", "singularName": "", "namespaced": r.namespaced,
                            "kind": kind, "verbs": verbs})
        return {"kind": "APIResourceList", "apiVersion": "v1", "groupVersion": gv, "resources": out}

    # ---- reads

    @staticmethod
    def _wants(req: _Req) -> str:
        """"table" when the client asks for a meta.k8s.io Table before plain JSON (kubectl get)."""
        for part in (req.h.headers.get("Accept") or "application/json").split(","):
            p = part.strip().lower().replace(" ", "")
            if "as=table" in p and "g=meta.k8s.io" in p:
                return "table"
            if "as=" not in p and ("json" in p or p.startswith("*/*") or p.startswith("application/*")):
                return "json"
        return "json"

    @staticmethod
    def _item(res: Resource, obj: dict) -> dict:
        # Typed lists of built-in kinds carry no kind/apiVersion per item; custom resources do.
        if res.is_crd:
            return obj
        return {k: v for k, v in obj.items() if k not in ("kind", "apiVersion")}

    def _list(self, req: _Req, res: Resource, ns: str | None, name: str | None, sub: str | None) -> None:
        items, rv = self.store.list(res.plural, ns, req.q("labelSelector"), field_selector=req.q("fieldSelector"))
        meta: dict[str, Any] = {"resourceVersion": rv}
        token = req.q("continue")
        if token:
            try:
                cont = json.loads(base64.b64decode(token))
                start, meta["resourceVersion"] = str(cont["start"]), str(cont["rv"])
            except (ValueError, KeyError, TypeError):
                raise BadRequest(f"continue key is not valid: {token!r}") from None
            items = [i for i in items if _list_key(i) >= start]
        try:
            limit = int(req.q("limit") or 0)
        except ValueError:
            raise BadRequest(f'limit: Invalid value: "{req.q("limit")}"') from None
        if limit > 0 and len(items) > limit:
            remaining = len(items) - limit
            items = items[:limit]
            nxt = {"v": "meta.k8s.io/v1", "rv": int(meta["resourceVersion"]), "start": _list_key(items[-1]) + "\x00"}
            meta["continue"] = base64.b64encode(json.dumps(nxt).encode()).decode()
            meta["remainingItemCount"] = remaining
        if self._wants(req) == "table":
            return self._send(req, 200, table(res, items, meta, req.q("includeObject", "PartialObjectMetadata")))
        self._send(req, 200, {"kind": f"{res.kind}List", "apiVersion": res.api_version, "metadata": meta,
                              "items": [self._item(res, i) for i in items]})

    def _get(self, req: _Req, res: Resource, ns: str | None, name: str | None, sub: str | None) -> None:
        obj = self.store.get(res.plural, ns or "", name or "")
        if obj is None:
            raise NotFound(f'{res.qualified} "{name}" not found', Store._details(res, name or ""))
        if self._wants(req) == "table":
            return self._send(req, 200, table(res, [obj], {"resourceVersion": obj["metadata"]["resourceVersion"]},
                                              req.q("includeObject", "PartialObjectMetadata")))
        self._send(req, 200, obj)

    # ---- writes

    @staticmethod
    def _body(req: _Req, allow_list: bool = False) -> Any:
        ctype = (req.h.headers.get("Content-Type") or "application/json").split(";")[0].strip().lower()
        try:
            if ctype in ("application/yaml", "application/x-yaml", "text/yaml"):
                import yaml
                doc = yaml.safe_load(req.body)
            else:
                doc = json.loads(req.body or b"null")
        except ValueError as e:
            raise BadRequest(f"the body of the request could not be decoded: {e}") from None
        if not isinstance(doc, dict) and not (allow_list and isinstance(doc, list)):
            raise BadRequest("the body of the request was in an unknown format - expected a JSON object")
        return doc

    @staticmethod
    def _own_namespace(res: Resource, obj: dict, ns: str | None) -> None:
        meta = obj.setdefault("metadata", {})
        if res.namespaced:
            if meta.get("namespace") and meta["namespace"] != ns:
                raise BadRequest("the namespace of the provided object does not match the namespace sent on the request")
            meta["namespace"] = ns

    def _create(self, req: _Req, res: Resource, ns: str | None, name: str | None, sub: str | None) -> None:
        if res.namespaced and ns is None:
            raise MethodNotAllowed("the server does not allow this method on the requested resource", {})
        obj = self._body(req)
        self._own_namespace(res, obj, ns)
        out = self.store.create(res.plural, obj, dry_run=req.q("dryRun") == "All")
        self._send(req, 201, out)

    def _update(self, req: _Req, res: Resource, ns: str | None, name: str | None, sub: str | None) -> None:
        obj = self._body(req)
        self._own_namespace(res, obj, ns)
        meta = obj["metadata"]
        if meta.get("name") and meta["name"] != name:
            raise BadRequest(f"the name of the object ({meta['name']}) does not match the name on the URL ({name})")
        meta["name"] = name
        if res.is_crd and not meta.get("resourceVersion"):  # CRDs allow no unconditional update
            raise Invalid(["metadata.resourceVersion: Invalid value: 0x0: must be specified for an update"],
                          kind=res.kind, group=res.group, name=name or "")
        self._send(req, 200, self.store.replace(res.plural, obj, part="status" if sub == "status" else "main"))

    def _patch(self, req: _Req, res: Resource, ns: str | None, name: str | None, sub: str | None) -> None:
        ctype = (req.h.headers.get("Content-Type") or "").split(";")[0].strip().lower()
        kind = _PATCH_TYPES.get(ctype)
        accepted = ["application/json-patch+json", "application/merge-patch+json"]
        if not res.is_crd:
            accepted.append("application/strategic-merge-patch+json")
        if ctype.startswith("application/apply-patch"):
            raise UnsupportedMediaType("the fake API server does not implement server-side apply "
                                       f"({ctype}); use a merge or JSON patch", {})
        if kind is None or (kind == "strategic" and res.is_crd):
            raise UnsupportedMediaType("the body of the request was in an unknown format - accepted media types "
                                       "include: " + ", ".join(accepted + ["application/apply-patch+yaml"]), {})
        try:
            patch = json.loads(req.body or b"null")
        except ValueError as e:
            raise BadRequest(f"error decoding patch: {e}") from None
        out = self.store.patch(res.plural, ns, name or "", patch, kind, part="status" if sub == "status" else "main")
        self._send(req, 200, out)

    def _delete_options(self, req: _Req) -> dict:
        opts: dict[str, Any] = {}
        if req.body.strip():
            opts = self._body(req)
        if req.q("propagationPolicy"):
            opts["propagationPolicy"] = req.q("propagationPolicy")
        policy = opts.get("propagationPolicy") or "Background"
        if policy not in ("Background", "Foreground", "Orphan"):
            raise Invalid([f'propagationPolicy: Unsupported value: "{policy}": supported values: "Foreground", '
                           '"Background", "Orphan"'])
        opts["propagationPolicy"] = policy
        return opts

    def _delete(self, req: _Req, res: Resource, ns: str | None, name: str | None, sub: str | None) -> None:
        opts = self._delete_options(req)
        out = self.store.delete(res.plural, ns, name or "", propagation=opts["propagationPolicy"],
                                preconditions=opts.get("preconditions"))
        if out is None:
            raise NotFound(f'{res.qualified} "{name}" not found', Store._details(res, name or ""))
        if self.store.get(res.plural, ns or "", name or "") is not None:  # finalizers: not gone yet
            return self._send(req, 202, out)
        if res.plural in _RETURNS_DELETED:
            return self._send(req, 200, out)
        details = Store._details(res, name or "")
        details["uid"] = out["metadata"]["uid"]
        self._send(req, 200, {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success",
                              "details": details})

    def _deletecollection(self, req: _Req, res: Resource, ns: str | None, name: str | None, sub: str | None) -> None:
        opts = self._delete_options(req)
        items, rv = self.store.list(res.plural, ns, req.q("labelSelector"), field_selector=req.q("fieldSelector"))
        gone = []
        for obj in items:
            m = obj["metadata"]
            out = self.store.delete(res.plural, m.get("namespace"), m["name"], propagation=opts["propagationPolicy"])
            if out is not None:
                gone.append(self._item(res, out))
        self._send(req, 200, {"kind": f"{res.kind}List", "apiVersion": res.api_version,
                              "metadata": {"resourceVersion": self.store.resource_version}, "items": gone})

    def _binding(self, req: _Req, ns: str, name: str) -> None:
        """POST pods/{name}/binding: what the scheduler does to put a pod on a node."""
        if req.method != "POST":
            raise MethodNotAllowed("the server does not allow this method on the requested resource", {})
        body = self._body(req)
        node = (body.get("target") or {}).get("name")
        if not node:
            raise Invalid(["target.name: Required value"], kind="Binding", name=name)
        pod = self.store.get("pods", ns, name)
        if pod is None:
            raise NotFound(f'pods "{name}" not found', {"name": name, "kind": "pods"})
        if pod["spec"].get("nodeName"):
            raise Conflict(f'Operation cannot be fulfilled on pods/binding "{name}": pod {name} is already assigned '
                           f'to node "{pod["spec"]["nodeName"]}"', {"name": name, "kind": "pods/binding"})
        pod["spec"]["nodeName"] = node
        conds = [c for c in (pod.get("status") or {}).get("conditions") or [] if c.get("type") != "PodScheduled"]
        conds.append({"type": "PodScheduled", "status": "True", "lastProbeTime": None,
                      "lastTransitionTime": now_rfc3339()})
        pod.setdefault("status", {})["conditions"] = conds
        self.store.replace("pods", pod)
        self._send(req, 201, {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success", "code": 201})

    # ---- watch

    def _watch(self, req: _Req, res: Resource, ns: str | None, name: str | None, sub: str | None) -> None:
        rv = req.q("resourceVersion") or None
        try:
            timeout = float(req.q("timeoutSeconds") or self.watch_timeout)
        except ValueError:
            raise BadRequest(f'timeoutSeconds: Invalid value: "{req.q("timeoutSeconds")}"') from None
        bookmarks = req.q("allowWatchBookmarks").lower() in ("true", "1")
        as_table = self._wants(req) == "table"
        include = req.q("includeObject", "PartialObjectMetadata")
        try:
            sub_ = self.store.watch(res.plural, ns, req.q("labelSelector"), rv, field_selector=req.q("fieldSelector"))
        except Gone as e:
            if self.watch_gone == "http":
                raise
            self._start_chunks(req)
            self._chunk(req, {"type": "ERROR", "object": e.status()})
            return self._end_chunks(req)
        h = req.h
        headers = True
        try:
            self._start_chunks(req)
            deadline = time.monotonic() + timeout
            last_mark = time.monotonic()
            while not self._stopping.is_set():
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                ev = sub_.get(timeout=min(left, 0.25))
                if ev is None:
                    if sub_.closed or _peer_closed(h.connection):
                        break
                    if bookmarks and time.monotonic() - last_mark >= self.bookmark_interval:
                        mark_rv = self.store.resource_version if sub_.idle() else None
                        if mark_rv is not None:
                            self._chunk(req, {"type": "BOOKMARK", "object": {
                                "kind": res.kind, "apiVersion": res.api_version,
                                "metadata": {"resourceVersion": mark_rv}}})
                            last_mark = time.monotonic()
                    continue
                kind, obj = ev
                if as_table and kind != "ERROR":
                    obj = table(res, [obj], {"resourceVersion": obj["metadata"]["resourceVersion"]}, include, headers)
                    headers = False
                self._chunk(req, {"type": kind, "object": obj})
                if kind == "ERROR":
                    break
            self._end_chunks(req)
        finally:
            sub_.close()

    def _start_chunks(self, req: _Req) -> None:
        h = req.h
        h.send_response(200)
        h.send_header("Content-Type", "application/json")
        h.send_header("Transfer-Encoding", "chunked")
        h.send_header("Cache-Control", "no-cache, private")
        h.end_headers()
        req.headers_sent = True
        h.close_connection = True

    @staticmethod
    def _chunk(req: _Req, doc: dict) -> None:
        data = json.dumps(doc).encode() + b"\n"
        req.h.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))

    @staticmethod
    def _end_chunks(req: _Req) -> None:
        try:
            req.h.wfile.write(b"0\r\n\r\n")
        except OSError:
            pass

    # ---- port-forward

    def _portforward(self, req: _Req, ns: str, name: str) -> None:
        """GET .../pods/{name}/portforward?ports=P with a WebSocket upgrade, as kubelet serves it
        behind the API server: channel 2i carries port i's bytes, 2i+1 its errors; both start with the
        port number (uint16 little-endian). kubectl's SPDY upgrade is not spoken."""
        h = req.h
        pod = self.store.get("pods", ns, name)
        if pod is None:
            raise NotFound(f'pods "{name}" not found', {"name": name, "kind": "pods"})
        if (h.headers.get("Upgrade") or "").lower() != "websocket" or req.method != "GET":
            raise BadRequest("Upgrade request required: the fake API server speaks port-forward over WebSocket "
                             "(v4.channel.k8s.io) only, not SPDY")
        ports: list[int] = []
        for value in req.query.get("ports", []):
            for p in value.split(","):
                try:
                    port = int(p)
                except ValueError:
                    raise BadRequest(f'unable to parse "{p}" as a port: invalid syntax') from None
                if not 0 < port < 65536:
                    raise BadRequest(f"port {port} must be > 0 and < 65536")
                ports.append(port)
        if not ports:
            raise BadRequest("at least 1 port must be specified")
        if not pod["spec"].get("nodeName"):
            raise BadRequest(f"pod {name} does not have a host assigned")
        offered = [p.strip() for p in (h.headers.get("Sec-WebSocket-Protocol") or "").split(",") if p.strip()]
        chosen = next((p for p in offered if p in _PF_PROTOCOLS), None) if offered else ""
        if chosen is None:
            raise Forbidden(f"websocket: requested protocol(s) are not supported: {offered}; "
                            f"supports {list(_PF_PROTOCOLS)}", {})
        key = h.headers.get("Sec-WebSocket-Key")
        if not key:
            raise BadRequest("websocket: missing Sec-WebSocket-Key")
        h.send_response(101, "Switching Protocols")
        h.send_header("Upgrade", "websocket")
        h.send_header("Connection", "Upgrade")
        h.send_header("Sec-WebSocket-Accept", ws_accept_key(key))
        if chosen:
            h.send_header("Sec-WebSocket-Protocol", chosen)
        h.end_headers()
        req.headers_sent = True
        h.close_connection = True
        _PortForward(self, h.connection, pod, ports, base64_mode="base64" in (chosen or "")).run()


def _list_key(obj: dict) -> str:
    m = obj.get("metadata") or {}
    return f"{m.get('namespace', '')}/{m.get('name', '')}"


def _peer_closed(conn: socket.socket) -> bool:
    """Whether an idle client hung up (a watch writes nothing for long stretches)."""
    try:
        readable, _, _ = select.select([conn], [], [], 0)
        if not readable:
            return False
        conn.settimeout(0.2)
        try:
            return conn.recv(1) == b""
        finally:
            conn.settimeout(None)
    except (OSError, ValueError, ssl.SSLError):
        return True


class _PortForward:
    """One port-forward session: a select loop relaying WebSocket channels to TCP connections
    to `pod.status.podIP`. One thread reads and writes the TLS socket (OpenSSL objects are not
    safe to use from two threads at once)."""

    def __init__(self, api: ApiServer, conn: socket.socket, pod: dict, ports: list[int], base64_mode: bool) -> None:
        self.api, self.conn, self.pod, self.ports, self.b64 = api, conn, pod, ports, base64_mode
        self.targets: dict[int, socket.socket] = {}  # data channel -> connection to the pod's port
        sandbox = hashlib.sha256(pod["metadata"]["uid"].encode()).hexdigest()
        self.sandbox = sandbox

    def send(self, channel: int, data: bytes) -> None:
        if self.b64:
            self.conn.sendall(ws_frame(str(channel).encode() + base64.b64encode(data), OP_TEXT))
        else:
            self.conn.sendall(ws_frame(bytes([channel]) + data, OP_BINARY))

    def error(self, i: int, port: int, why: str) -> None:
        self.send(2 * i + 1, f"error forwarding port {port} to pod {self.sandbox}, uid : {why}".encode())

    def run(self) -> None:
        st = self.pod.get("status") or {}
        ip = st.get("podIP")
        try:
            for i, port in enumerate(self.ports):
                self.send(2 * i, struct.pack("<H", port))
                self.send(2 * i + 1, struct.pack("<H", port))
            for i, port in enumerate(self.ports):
                if st.get("phase") != "Running" or not ip:
                    self.error(i, port, f"pod is not running (phase {st.get('phase') or 'Pending'}, no sandbox)")
                    continue
                try:
                    self.targets[2 * i] = socket.create_connection((ip, port), timeout=5)
                    self.targets[2 * i].settimeout(None)
                except OSError as e:
                    self.error(i, port, f'failed to connect to localhost:{port} inside namespace "{self.sandbox}", '
                                        f"IPv4: dial tcp4 127.0.0.1:{port}: connect: connection refused "
                                        f"IPv6 dial tcp6 [::1]:{port}: connect: {e.strerror or e}")
            if not self.targets:
                self.close(1000)
                return
            self.loop()
        except (OSError, ssl.SSLError):
            pass
        finally:
            for s in self.targets.values():
                try:
                    s.close()
                except OSError:
                    pass

    def close(self, code: int) -> None:
        try:
            self.conn.sendall(ws_frame(struct.pack("!H", code), OP_CLOSE))
        except OSError:
            pass

    def loop(self) -> None:
        reader = WsReader()
        by_sock = {s: ch for ch, s in self.targets.items()}
        while not self.api._stopping.is_set():
            pending = isinstance(self.conn, ssl.SSLSocket) and self.conn.pending()
            ready = [self.conn] if pending else select.select([self.conn, *by_sock], [], [], 0.2)[0]
            for s in ready:
                if s is self.conn:
                    data = self.conn.recv(65536)
                    if not data:
                        return
                    for op, payload in reader.feed(data):
                        if op == OP_CLOSE:
                            self.conn.sendall(ws_frame(payload[:2] or struct.pack("!H", 1000), OP_CLOSE))
                            return
                        if op == OP_PING:
                            self.conn.sendall(ws_frame(payload, OP_PONG))
                        elif op in (OP_BINARY, OP_TEXT) and payload:
                            if self.b64 or op == OP_TEXT:
                                channel, payload = int(chr(payload[0])), base64.b64decode(payload[1:])
                            else:
                                channel, payload = payload[0], payload[1:]
                            target = self.targets.get(channel)
                            if target is not None and payload:
                                target.sendall(payload)
                else:
                    ch = by_sock[s]
                    try:
                        data = s.recv(65536)
                    except OSError:
                        data = b""
                    if data:
                        self.send(ch, data)
                    else:  # the pod closed this port: kubelet ends the session when all ports are done
                        del by_sock[s]
                        self.targets.pop(ch).close()
                        if not by_sock:
                            self.close(1000)
                            return
