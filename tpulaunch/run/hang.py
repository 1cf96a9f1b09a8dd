"""Hang triage: from every host's Python stacks to the hosts that caused the hang. Pure.

A multi-host SPMD program hangs when one host does not reach a collective the others wait in: its
input stalls, it runs other code, it died in a way its peers did not notice. The stacks say which:
each host is classified by the innermost frame of its main thread that says what it waits for,

* `collective`: a cross-host operation (torch.distributed's all_reduce, all_gather, barrier, ...;
  JAX's process_allgather / sync_global_devices; XLA executing a program that waits on its peers:
  torch_xla's mark_step / wait_device_ops, a jitted call's `block_until_ready`);
* `input`: loading data (a DataLoader, a file or socket read, a function named for its batches);
* `python`: anywhere else.

The hosts not where the others wait are the culprits (`hang: host 3 (slice 1 worker 1) is in
load_batch (train.py:23); the other 3 wait in all_reduce (distributed_c10d.py:2942)`). When every
host waits in a collective, the cause is outside them (a peer that is gone, the network): no host is
named. `Hang` is what the summary, `status` and `--replace-hung` read.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

COLLECTIVE, INPUT, PYTHON = "collective", "input", "python"

_FRAME = re.compile(r"^\s+(?P<func>\S[^()]*?)\s*\((?P<file>[^()]*?):(?P<line>\d+)\)\s*$")
# a cross-host operation whatever file it is in
_COLLECTIVE_FUNCS = re.compile(
    r"^(all_?reduce(_coalesced)?|all_?gather(_into_tensor|_object)?|reduce_?scatter(_tensor)?|all_?to_?all(_single)?"
    r"|barrier|monitored_barrier|wait_device_ops|mark_step|_xla_sync_multi|sync_global_devices|process_allgather"
    r"|broadcast_one_to_all|block_until_ready|_wait_for_tokens|wait_for_all_devices)$")
# where a frame of any name is a collective, or XLA executing a program that waits on its peers
_COLLECTIVE_FILES = re.compile(r"(distributed_c10d|c10d_logger|multihost_utils|torch_xla/core/xla_model|/pjit\.py"
                               r"|/pxla\.py|/dispatch\.py|megascale)", re.I)
_INPUT_FUNCS = re.compile(r"(load|read|fetch|next_batch|get_batch|batch|dataloader|data_loader|_next_data|__next__"
                          r"|recv_into|readinto|input|prefetch|iterator|dataset)", re.I)
_INPUT_FILES = re.compile(r"(torch/utils/data|dataloader|grain|tensorflow/python/data|datasets/|webdataset|fsspec"
                          r"|gcsfs|s3fs|/io\.py|/socket\.py|/ssl\.py|/selectors\.py)", re.I)
# waits that say nothing by themselves: look at who called them
_GENERIC = re.compile(r"/(threading|queue|time|contextlib|functools)\.py$")
# libtpu's own word that a multislice program hangs (its Megascale digest), when it reaches a host log
LIBTPU_HANG = re.compile(r"Megascale hang detected|HANG_DETECTED", re.I)


@dataclass(frozen=True)
class Place:
    """Where one host is: its kind of wait and the frame that says so."""

    kind: str  # COLLECTIVE, INPUT, PYTHON
    frame: str  # "load_batch (train.py:23)"


def main_thread_frames(dump: str) -> list[tuple[str, str]]:
    """The main thread's frames in a `py-spy dump`, innermost first: (function, file:line)."""
    lines = dump.splitlines()
    start = next((k for k, line in enumerate(lines) if line.startswith("Thread") and "MainThread" in line), None)
    out = []
    for line in lines[(start + 1) if start is not None else 0:]:
        if line.startswith("Thread"):
            break
        m = _FRAME.match(line)
        if m:
            out.append((m.group("func"), f"{m.group('file')}:{m.group('line')}"))
    return out


def _short(func: str, where: str) -> str:
    file, _, line = where.rpartition(":")
    return f"{func} ({file.rsplit('/', 1)[-1]}:{line})"


def place_of(dump: str) -> Place:
    """What one host's stacks say it waits for (see the module docstring)."""
    frames = main_thread_frames(dump)
    if not frames:
        return Place(PYTHON, "an unknown place (no Python stack)")
    for func, where in frames:  # innermost first: the first frame that says what it waits for
        name = func.rsplit(".", 1)[-1]
        file = where.rpartition(":")[0]
        if _GENERIC.search(file):
            continue
        if _COLLECTIVE_FUNCS.match(name) or _COLLECTIVE_FILES.search(file):
            return Place(COLLECTIVE, _short(func, where))
        if _INPUT_FILES.search(file) or _INPUT_FUNCS.search(name):
            return Place(INPUT, _short(func, where))
    first = next(((f, w) for f, w in frames if not _GENERIC.search(w.rpartition(":")[0])), frames[0])
    return Place(PYTHON, _short(*first))


@dataclass(frozen=True)
class HostRef:
    """A host as the line names it."""

    process_index: int
    slice_index: int
    worker_id: int


@dataclass(frozen=True)
class Hang:
    """A hang, triaged: the culprits (none when every host waits in a collective), where they are,
    and where the others wait."""

    places: dict[int, Place]  # process index -> its place
    culprits: tuple[int, ...]
    where: str  # the culprits' frame(s)
    others: str  # where the others wait
    line: str
    slices: tuple[int, ...] = field(default=())  # the culprits' slices (what --replace-hung replaces)

    def to_dict(self) -> dict:
        return {"culprits": list(self.culprits), "where": self.where, "others": self.others,
                "slices": list(self.slices), "line": self.line,
                "hosts": {str(i): {"kind": p.kind, "frame": p.frame} for i, p in sorted(self.places.items())}}

    @staticmethod
    def from_dict(d: dict) -> Hang:
        return Hang({int(k): Place(v["kind"], v["frame"]) for k, v in (d.get("hosts") or {}).items()},
                    tuple(d.get("culprits") or ()), d.get("where", ""), d.get("others", ""), d.get("line", ""),
                    tuple(d.get("slices") or ()))


def _hosts_text(ps: list[int]) -> str:
    return f"host{'s' if len(ps) > 1 else ''} {','.join(map(str, ps))}"


def triage(dumps: dict[int, str], hosts: list[HostRef]) -> Hang:
    """The hang the stacks show (`dumps`: process index -> `py-spy dump`)."""
    places = {i: place_of(d) for i, d in sorted(dumps.items())}
    refs = {h.process_index: h for h in hosts}
    waiting = sorted(i for i, p in places.items() if p.kind == COLLECTIVE)
    rest = sorted(i for i in places if i not in waiting)
    if waiting and rest:
        frames = _common([places[i].frame for i in rest])
        others = _common([places[i].frame for i in waiting])
        culprits = tuple(rest)
        named = ("; ".join(f"host {i} (slice {refs[i].slice_index} worker {refs[i].worker_id}) is in {places[i].frame}"
                           for i in culprits) if len(culprits) <= 3 else
                 f"{_hosts_text(list(culprits))} are in {frames}")
        line = f"hang: {named}; the other {len(waiting)} wait in {others}"
        return Hang(places, culprits, frames, others, line,
                    tuple(sorted({refs[i].slice_index for i in culprits if i in refs})))
    if waiting:
        others = _common([places[i].frame for i in waiting])
        return Hang(places, (), "", others,
                    f"hang: all {len(waiting)} hosts wait in {others}: none of them is the cause (a peer gone, the"
                    " network, a program that differs between hosts)")
    frames = "; ".join(f"{_hosts_text(ps)}: in {f}" for f, ps in _group(places).items())
    return Hang(places, (), frames, "", f"hang: no host waits in a collective ({frames})")


def _group(places: dict[int, Place]) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for i, p in sorted(places.items()):
        out.setdefault(p.frame, []).append(i)
    return out


def _common(frames: list[str]) -> str:
    """The most common frame (ties: the first), and how many others differ."""
    counts: dict[str, int] = {}
    for f in frames:
        counts[f] = counts.get(f, 0) + 1
    best = max(counts, key=lambda f: (counts[f], -frames.index(f)))
    return best if len(counts) == 1 else f"{best} (and {len(counts) - 1} other place(s))"
