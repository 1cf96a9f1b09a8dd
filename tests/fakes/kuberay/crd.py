"""KubeRay's RayCluster CRD (v1.7.0, vendored as `ray.io_rayclusters.yaml`), enforced as the API server does.

The fake API server must refuse what a real one refuses: a RayCluster with a wrong type, a missing
required field or a bad enum is a 422 there, so tests catch it here. Two differences, on purpose:

* Unknown fields are errors (`spec.workerGroupSpecs[0].numOfHost: unknown field`). A real server
  prunes them (with a warning, or a 400 under `fieldValidation=Strict`); a fake that silently
  dropped a typo'd field would hide exactly the bug a test is for.
* Of the CEL rules (`x-kubernetes-validations`) only the two shapes this CRD uses are evaluated:
  `self == oldSelf` (on update) and `self in [...]`.

Also here: structural-schema defaulting (`apply_defaults`: `replicas: 0`, `minReplicas: 0`,
`maxReplicas: 2147483647`, `numOfHosts: 1`, `priority: 0`, `protocol: TCP`, ...), done where the
real server does it (when an object is decoded, for fields absent from objects that exist), and
the version's `additionalPrinterColumns`, for the server-side tables kubectl asks for.

The 933 KB YAML is parsed once (PyYAML's C loader, ~0.2 s) and cached.
"""

from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

CRD_FILE = Path(__file__).with_name("ray.io_rayclusters.yaml")
GROUP, KIND, PLURAL = "ray.io", "RayCluster", "rayclusters"
_MISSING = object()


@functools.lru_cache(maxsize=None)
def definition() -> dict:
    """The CustomResourceDefinition object, parsed once."""
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    with open(CRD_FILE, encoding="utf-8") as f:
        return yaml.load(f, Loader=loader)  # noqa: S506 - a safe loader


def version(name: str = "v1") -> dict:
    for v in definition()["spec"]["versions"]:
        if v["name"] == name:
            return v
    raise KeyError(f"{GROUP}/{name} is not a version of the {KIND} CRD")


def schema(name: str = "v1") -> dict:
    return version(name)["schema"]["openAPIV3Schema"]


def printer_columns(name: str = "v1") -> list[dict]:
    """The version's additionalPrinterColumns (jsonPath, name, type, priority)."""
    return list(version(name).get("additionalPrinterColumns") or [])


@dataclass(frozen=True)
class FieldError:
    """One validation error, as Kubernetes' field.Error: the path, the cause's reason, the detail."""

    field: str
    reason: str  # FieldValueRequired, FieldValueInvalid, FieldValueTypeInvalid, FieldValueNotSupported, ...
    detail: str

    @property
    def message(self) -> str:
        return f"{self.field}: {self.detail}"


def _type_name(v: Any) -> str:
    if isinstance(v, bool):
        return "boolean"
    if isinstance(v, int):
        return "integer"
    if isinstance(v, float):
        return "number"
    if isinstance(v, str):
        return "string"
    if isinstance(v, list):
        return "array"
    if isinstance(v, dict):
        return "object"
    return "null"


def _is_type(v: Any, t: str) -> bool:
    if t == "object":
        return isinstance(v, dict)
    if t == "array":
        return isinstance(v, list)
    if t == "string":
        return isinstance(v, str)
    if t == "boolean":
        return isinstance(v, bool)
    if t == "integer":
        return isinstance(v, int) and not isinstance(v, bool)
    if t == "number":
        return isinstance(v, (int, float)) and not isinstance(v, bool)
    return True


def _go(v: Any) -> str:
    """A value as Kubernetes quotes it in 'Invalid value: ...' (JSON, strings quoted)."""
    return json.dumps(v, separators=(",", ":"), sort_keys=True)


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def _walk(v: Any, s: dict, path: str, old: Any, out: list[FieldError]) -> None:
    if v is None:  # null in a non-nullable field is pruned by the real server: treated as absent
        return
    int_or_string = s.get("x-kubernetes-int-or-string")
    if int_or_string:
        if not (_is_type(v, "integer") or _is_type(v, "string")):
            out.append(FieldError(path, "FieldValueTypeInvalid",
                                  f'Invalid value: "{_type_name(v)}": {path} in body must be of type integer,string: '
                                  f'"{_type_name(v)}"'))
            return
    elif "type" in s and not _is_type(v, s["type"]):
        out.append(FieldError(path, "FieldValueTypeInvalid",
                              f'Invalid value: "{_type_name(v)}": {path} in body must be of type {s["type"]}: '
                              f'"{_type_name(v)}"'))
        return
    if "enum" in s and v not in s["enum"]:
        supported = ", ".join(_go(e) for e in s["enum"])
        out.append(FieldError(path, "FieldValueNotSupported", f"Unsupported value: {_go(v)}: supported values: {supported}"))
    if isinstance(v, str):
        if "maxLength" in s and len(v) > s["maxLength"]:
            out.append(FieldError(path, "FieldValueTooLong", f"Too long: may not be more than {s['maxLength']} bytes"))
        if "minLength" in s and len(v) < s["minLength"]:
            out.append(FieldError(path, "FieldValueInvalid",
                                  f"Invalid value: {_go(v)}: {path} in body should be at least {s['minLength']} chars long"))
        if "pattern" in s and not re.search(s["pattern"], v):
            out.append(FieldError(path, "FieldValueInvalid",
                                  f"Invalid value: {_go(v)}: {path} in body should match '{s['pattern']}'"))
    if _is_type(v, "number"):
        if "minimum" in s and v < s["minimum"]:
            out.append(FieldError(path, "FieldValueInvalid",
                                  f"Invalid value: {v}: {path} in body should be greater than or equal to {s['minimum']}"))
        if "maximum" in s and v > s["maximum"]:
            out.append(FieldError(path, "FieldValueInvalid",
                                  f"Invalid value: {v}: {path} in body should be less than or equal to {s['maximum']}"))
    if "anyOf" in s and not int_or_string:
        branch_errors = []
        for b in s["anyOf"]:
            errs: list[FieldError] = []
            _walk(v, b, path, old, errs)
            branch_errors.append(errs)
        if all(branch_errors):
            out.append(FieldError(path, "FieldValueInvalid",
                                  f"Invalid value: {_go(v)}: must validate at least one schema (anyOf)"))
    for rule in s.get("x-kubernetes-validations") or []:
        _cel(rule, v, old, path, out)
    if isinstance(v, dict):
        _walk_object(v, s, path, old if isinstance(old, dict) else None, out)
    elif isinstance(v, list):
        _walk_array(v, s, path, out)


def _walk_object(v: dict, s: dict, path: str, old: dict | None, out: list[FieldError]) -> None:
    props = s.get("properties") or {}
    extra = s.get("additionalProperties")
    preserve = s.get("x-kubernetes-preserve-unknown-fields")
    for key in s.get("required") or []:
        if v.get(key) is None:
            out.append(FieldError(_join(path, key), "FieldValueRequired", "Required value"))
    for key, val in v.items():
        sub = _join(path, key)
        if key in props:
            _walk(val, props[key], sub, (old or {}).get(key, _MISSING), out)
        elif isinstance(extra, dict):
            _walk(val, extra, sub, (old or {}).get(key, _MISSING), out)
        elif not (preserve or extra is True):
            out.append(FieldError(sub, "FieldValueInvalid", "unknown field"))


def _walk_array(v: list, s: dict, path: str, out: list[FieldError]) -> None:
    items = s.get("items")
    if isinstance(items, dict):
        for i, item in enumerate(v):
            _walk(item, items, f"{path}[{i}]", _MISSING, out)
    list_type = s.get("x-kubernetes-list-type")
    seen: set[str] = set()
    for i, item in enumerate(v):
        if list_type == "map" and isinstance(item, dict):
            keys = {k: item.get(k) for k in s.get("x-kubernetes-list-map-keys") or []}
            ident = _go(keys)
            shown = "map[string]interface {}{" + ", ".join(f'"{k}":{_go(x)}' for k, x in keys.items()) + "}"
        elif list_type == "set":
            ident = shown = _go(item)
        else:
            continue
        if ident in seen:
            out.append(FieldError(f"{path}[{i}]", "FieldValueDuplicate", f"Duplicate value: {shown}"))
        seen.add(ident)


def _cel(rule: dict, v: Any, old: Any, path: str, out: list[FieldError]) -> None:
    text = rule.get("rule", "").strip()
    bad = False
    if text == "self == oldSelf":
        bad = old is not _MISSING and old is not None and old != v
    elif m := re.fullmatch(r"self in \[(.*)\]", text):
        allowed = [x.strip().strip("'\"") for x in m.group(1).split(",")]
        bad = v not in allowed
    else:
        return  # a rule this fake cannot evaluate: not enforced (none in this CRD)
    if bad:
        msg = rule.get("message") or f"failed rule: {text}"
        out.append(FieldError(path, "FieldValueInvalid", f'Invalid value: "{_type_name(v)}": {msg}'))


def errors(obj: dict, old: dict | None = None, version_name: str = "v1") -> list[FieldError]:
    """Every schema error of `obj` (a RayCluster dict), `old` being the stored object on update."""
    out: list[FieldError] = []
    if obj.get("apiVersion") not in (f"{GROUP}/{version_name}", None):
        out.append(FieldError("apiVersion", "FieldValueInvalid",
                              f"Invalid value: {_go(obj.get('apiVersion'))}: must be {GROUP}/{version_name}"))
    if obj.get("kind") not in (KIND, None):
        out.append(FieldError("kind", "FieldValueInvalid", f"Invalid value: {_go(obj.get('kind'))}: must be {KIND}"))
    top = dict(schema(version_name))
    # ObjectMeta is validated by the API server's own rules, not by the CRD schema.
    body = {k: val for k, val in obj.items() if k != "metadata"}
    top["properties"] = {k: val for k, val in top.get("properties", {}).items() if k != "metadata"}
    _walk(body, top, "", old if old is not None else _MISSING, out)
    return out


def validate(obj: dict, old: dict | None = None) -> list[str]:
    """Messages (`<path>: <what>`) for every way `obj` breaks the v1 schema; [] when it is valid."""
    return [e.message for e in errors(obj, old)]


# -- defaulting ------------------------------------------------------------------------------------


def _default(v: Any, s: dict) -> Any:
    if isinstance(v, dict) and (s.get("type") == "object" or "properties" in s):
        props = s.get("properties") or {}
        for key in list(v):
            if v[key] is None and not (props.get(key) or {}).get("nullable"):
                del v[key]  # non-nullable nulls are pruned, then defaulted
        for key, sub in props.items():
            if key not in v and "default" in sub:
                v[key] = json.loads(json.dumps(sub["default"]))
            if key in v:
                v[key] = _default(v[key], sub)
        extra = s.get("additionalProperties")
        if isinstance(extra, dict):
            for key in v:
                if key not in props:
                    v[key] = _default(v[key], extra)
    elif isinstance(v, list) and isinstance(s.get("items"), dict):
        for i, item in enumerate(v):
            v[i] = _default(item, s["items"])
    return v


def apply_defaults(obj: dict, version_name: str = "v1") -> dict:
    """Apply the schema's defaults to `obj` in place (and return it), as the API server does on decode."""
    s = schema(version_name)
    for key, sub in s.get("properties", {}).items():
        if key != "metadata" and key in obj:
            obj[key] = _default(obj[key], sub)
    return obj


def json_path(obj: dict, path: str) -> Any:
    """A printer column's simple JSONPath (`.status.head.podIP`) in `obj`, or None."""
    cur: Any = obj
    for part in [p for p in path.strip().lstrip(".").split(".") if p]:
        cur = cur.get(part) if isinstance(cur, dict) else None
    return cur
