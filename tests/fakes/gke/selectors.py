"""Label and field selectors, parsed and matched as the Kubernetes API server does.

Label selectors follow `k8s.io/apimachinery/pkg/labels/selector.go`: comma-separated requirements
`key`, `!key`, `key=v`, `key==v`, `key!=v`, `key in (a,b)`, `key notin (a,b)`, `key>N`, `key<N`.
The lexer treats `= ! ( ) , < >` and whitespace as separators, so `a=b,c in (d, e)` parses as two
requirements. `!=` and `notin` also match objects without the label, as the real ones do. Keys
and values are validated (qualified names, label values), so a selector the real server refuses
is refused here too (`SelectorError`, which the API answers with 400 BadRequest).

Field selectors follow `k8s.io/apimachinery/pkg/fields/selector.go`: `f=v`, `f==v`, `f!=v`, with
backslash escapes, on the few fields each resource supports (anything else is
`field label not supported: <f>`, as the real server says).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Callable

_SPECIAL = set("=!(),<>")
_NAME = re.compile(r"^[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$")
_DNS1123_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")


class SelectorError(ValueError):
    """A selector the API server would refuse (HTTP 400 BadRequest)."""


@dataclass(frozen=True)
class Requirement:
    key: str
    op: str  # "=", "!=", "in", "notin", "exists", "!", "gt", "lt"
    values: tuple[str, ...] = ()

    def matches(self, labels: dict[str, str]) -> bool:
        has = self.key in labels
        value = labels.get(self.key)
        if self.op in ("=", "in"):
            return has and value in self.values
        if self.op in ("!=", "notin"):
            return not has or value not in self.values
        if self.op == "exists":
            return has
        if self.op == "!":
            return not has
        if not has:
            return False
        try:
            n, bound = int(value or ""), int(self.values[0])
        except ValueError:
            return False
        return n > bound if self.op == "gt" else n < bound


def _tokens(text: str) -> list[tuple[str, str]]:
    """(kind, text) tokens: kind is "id", "op" (one of = == != ! ( ) , < >) or "kw" (in, notin)."""
    out: list[tuple[str, str]] = []
    i = 0
    while i < len(text):
        c = text[i]
        if c.isspace():
            i += 1
        elif c in _SPECIAL:
            two = text[i:i + 2]
            if two in ("==", "!="):
                out.append(("op", two))
                i += 2
            else:
                out.append(("op", c))
                i += 1
        else:
            j = i
            while j < len(text) and not text[j].isspace() and text[j] not in _SPECIAL:
                j += 1
            word = text[i:j]
            out.append(("kw" if word in ("in", "notin") else "id", word))
            i = j
    return out


def validate_label_key(key: str) -> str | None:
    """Why `key` is not a valid label key (a qualified name), or None."""
    prefix, _, name = key.rpartition("/")
    if "/" in key and not prefix:
        return "prefix part must be non-empty"
    if prefix and (len(prefix) > 253 or not _DNS1123_SUBDOMAIN.match(prefix)):
        return ("prefix part a lowercase RFC 1123 subdomain must consist of lower case alphanumeric characters, '-' or '.', "
                "and must start and end with an alphanumeric character (e.g. 'example.com', regex used for validation "
                "is '[a-z0-9]([-a-z0-9]*[a-z0-9])?(\\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*')")
    if not name:
        return "name part must be non-empty"
    if len(name) > 63:
        return "name part must be no more than 63 characters"
    if not _NAME.match(name):
        return ("name part must consist of alphanumeric characters, '-', '_' or '.', and must start and end with an "
                "alphanumeric character (e.g. 'MyName',  or 'my.name',  or '123-abc', regex used for validation is "
                "'([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]')")
    return None


def validate_label_value(value: str) -> str | None:
    """Why `value` is not a valid label value, or None."""
    if len(value) > 63:
        return "must be no more than 63 characters"
    if not _VALUE.match(value):
        return ("a valid label must be an empty string or consist of alphanumeric characters, '-', '_' or '.', and must "
                "start and end with an alphanumeric character (e.g. 'MyValue',  or 'my_value',  or '12345', regex used "
                "for validation is '(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?')")
    return None


def parse_labels(text: str) -> list[Requirement]:
    """Parse a label selector; an empty one selects everything. Raises SelectorError."""
    toks = _tokens(text or "")
    pos = 0
    reqs: list[Requirement] = []

    def peek() -> tuple[str, str]:
        return toks[pos] if pos < len(toks) else ("eos", "")

    def take() -> tuple[str, str]:
        nonlocal pos
        tok = peek()
        pos += 1
        return tok

    def key_of(tok: tuple[str, str]) -> str:
        if tok[0] != "id":
            raise SelectorError(f"unable to parse requirement: found '{tok[1]}', expected: identifier")
        why = validate_label_key(tok[1])
        if why:
            raise SelectorError(f'unable to parse requirement: key: Invalid value: "{tok[1]}": {why}')
        return tok[1]

    def value_ok(v: str) -> str:
        why = validate_label_value(v)
        if why:
            raise SelectorError(f'unable to parse requirement: values[0][{v}]: Invalid value: "{v}": {why}')
        return v

    if not toks:
        return []
    while True:
        tok = take()
        if tok == ("op", "!"):
            reqs.append(Requirement(key_of(take()), "!"))
        else:
            key = key_of(tok)
            nxt = peek()
            if nxt[0] == "eos" or nxt == ("op", ","):
                reqs.append(Requirement(key, "exists"))
            elif nxt[0] == "kw":
                take()
                if take() != ("op", "("):
                    raise SelectorError("found '" + peek()[1] + "', expected: '('")
                values: list[str] = []
                while True:
                    t = take()
                    if t == ("op", ")"):
                        break
                    if t == ("op", ","):
                        continue
                    if t[0] != "id":
                        raise SelectorError(f"found '{t[1]}', expected: ',', ')' or identifier")
                    values.append(value_ok(t[1]))
                if not values:
                    raise SelectorError("unable to parse requirement: values: Invalid value: []: "
                                        "for 'in', 'notin' operators, values set can't be empty")
                reqs.append(Requirement(key, nxt[1], tuple(values)))
            elif nxt[0] == "op" and nxt[1] in ("=", "==", "!=", ">", "<"):
                take()
                vt = peek()
                value = ""
                if vt[0] == "id":
                    value = take()[1]
                elif nxt[1] in (">", "<") or vt not in (("eos", ""), ("op", ",")):
                    raise SelectorError(f"found '{vt[1]}', expected: identifier")
                if nxt[1] in (">", "<"):
                    if not re.fullmatch(r"-?\d+", value):
                        raise SelectorError(f"unable to parse requirement: values[0]: Invalid value: \"{value}\": "
                                            "for 'Gt', 'Lt' operators, the value must be an integer")
                    reqs.append(Requirement(key, "gt" if nxt[1] == ">" else "lt", (value,)))
                else:
                    reqs.append(Requirement(key, "!=" if nxt[1] == "!=" else "=", (value_ok(value),)))
            else:
                raise SelectorError(f"found '{nxt[1]}', expected: in, notin, =, ==, !=, gt, lt")
        end = take()
        if end[0] == "eos":
            return reqs
        if end != ("op", ","):
            raise SelectorError(f"found '{end[1]}', expected: ',' or 'end of string'")


def match_labels(reqs: list[Requirement], labels: dict[str, str] | None) -> bool:
    labels = labels or {}
    return all(r.matches(labels) for r in reqs)


# -- field selectors ------------------------------------------------------------------------------

# The fields each resource's API supports (pkg/registry/*/strategy.go GetAttrs / *ToSelectableFields;
# CRDs: metadata.name and metadata.namespace). metadata.* is always allowed.
FIELDS: dict[str, tuple[str, ...]] = {
    "pods": ("spec.nodeName", "spec.restartPolicy", "spec.schedulerName", "spec.serviceAccountName",
             "spec.hostNetwork", "status.phase", "status.podIP", "status.nominatedNodeName"),
    "nodes": ("spec.unschedulable",),
    "namespaces": ("status.phase",),
    "secrets": ("type",),
    "events": ("involvedObject.kind", "involvedObject.namespace", "involvedObject.name", "involvedObject.uid",
               "involvedObject.apiVersion", "involvedObject.resourceVersion", "involvedObject.fieldPath", "reason",
               "reportingComponent", "source", "type"),
}


@dataclass(frozen=True)
class FieldTerm:
    field: str
    negate: bool
    value: str


def _split_unescaped(text: str, sep: str) -> list[str]:
    parts, cur, i = [], "", 0
    while i < len(text):
        if text[i] == "\\" and i + 1 < len(text):
            cur += text[i:i + 2]
            i += 2
            continue
        if text[i] == sep:
            parts.append(cur)
            cur = ""
        else:
            cur += text[i]
        i += 1
    parts.append(cur)
    return parts


def _unescape(v: str) -> str:
    return re.sub(r"\\(.)", r"\1", v)


def parse_fields(text: str, plural: str) -> list[FieldTerm]:
    """Parse a field selector for `plural`. Raises SelectorError for bad syntax or unsupported fields."""
    terms: list[FieldTerm] = []
    for part in _split_unescaped(text or "", ","):
        if not part:
            continue
        m = re.match(r"^((?:[^=!\\]|\\.)*)(!=|==|=)(.*)$", part)
        if not m:
            raise SelectorError(f"invalid selector: '{text}'; can't understand '{part}'")
        field, op, value = m.group(1), m.group(2), _unescape(m.group(3))
        allowed = ("metadata.name", "metadata.namespace") + FIELDS.get(plural, ())
        if field not in allowed:
            raise SelectorError(f'field label not supported: {field}')
        terms.append(FieldTerm(field, op == "!=", value))
    return terms


def field_value(obj: dict[str, Any], field: str) -> str:
    """The string form of `field` in `obj`, as the API's field sets hold it ("" when absent)."""
    cur: Any = obj
    for part in field.split("."):
        cur = cur.get(part) if isinstance(cur, dict) else None
    if isinstance(cur, bool):
        return "true" if cur else "false"
    if isinstance(cur, dict):  # events' `source` field is source.component
        cur = cur.get("component")
    return "" if cur is None else str(cur)


def match_fields(terms: list[FieldTerm], obj: dict[str, Any]) -> bool:
    return all((field_value(obj, t.field) == t.value) != t.negate for t in terms)


def selector(labels: str = "", fields: str = "", plural: str = "") -> Callable[[dict], bool]:
    """A predicate for objects matching both selectors (parsed once). Raises SelectorError."""
    lreqs = parse_labels(labels)
    fterms = parse_fields(fields, plural)
    return lambda obj: match_labels(lreqs, (obj.get("metadata") or {}).get("labels")) and match_fields(fterms, obj)
