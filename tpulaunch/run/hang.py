"""Hang triage: from every host's Python stacks to the hosts that caused the hang. Pure.

A multi-host SPMD program hangs when one host does not reach a collective the others wait in: its
input stalls, it runs other code, it died in a way its peers did not notice. The stacks say which:
each host is classified by the innermost frame of its main thread that says what it waits for,

* `collective`: a cross-host operation (torch.distributed's all_reduce, all_gather, barrier, ...;
  JAX's process_allgather / sync_global_devices; XLA executing a program that waits on its peers:
  torch_xla's mark_step / wait_device_ops, a jitted call's `block_until_ready`);
* `input`: loading data (a DataLoader, a file or socket read; the host's innermost function named
  for its batches);
* `python`: anywhere else (compiling too: a host that compiles is not waiting on its peers);
* `unknown`: no stack to read (py-spy failed, or the process had ended): never a culprit.

py-spy prints a file as its package's part (`torch/utils/data/dataloader.py`), the standard
library's by its name alone (`threading.py`); the rules take that and full paths alike. A
TorchTPU host is tpulaunch's parent of one process per device (`host/ranks.py`): its place is the
first rank not in a collective, else its first rank's.

The hosts not where the others wait are the culprits (`hang: host 3 (slice 1 worker 1) is in
load_batch (train.py:23); the other 3 wait in all_reduce (distributed_c10d.py:2942)`). When every
host waits in a collective, the cause is outside them (a peer that is gone, the network): no host is
named. `Hang` is what the summary, `status` and `--replace-hung` read.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

COLLECTIVE, INPUT, PYTHON, UNKNOWN = "collective", "input", "python", "unknown"

_FRAME = re.compile(r"^\s+(?P<func>\S[^()]*?)\s*\((?P<file>[^()]*?):(?P<line>\d+)\)\s*$")
# a cross-host operation whatever file it is in
_COLLECTIVE_FUNCS = re.compile(
    r"^(all_?reduce(_coalesced)?|all_?gather(_into_tensor|_object)?|reduce_?scatter(_tensor)?|all_?to_?all(_single)?"
    r"|barrier|monitored_barrier|wait_device_ops|mark_step|_xla_sync_multi|sync_global_devices|process_allgather"
    r"|broadcast_one_to_all|block_until_ready|_wait_for_tokens|wait_for_all_devices|device_get)$")
# where a frame of any name is a collective, or XLA executing a program that waits on its peers
# (torch_xla.sync() and JAX's float(x) / np.asarray(x) wait for a program's results, its collectives in it)
_COLLECTIVE_FILES = re.compile(r"(distributed_c10d|c10d_logger|multihost_utils|torch_xla/core/xla_model"
                               r"|torch_xla/torch_xla\.py|jax/_src/array\.py|(^|/)pjit\.py|(^|/)pxla\.py"
                               r"|(^|/)dispatch\.py|megascale)", re.I)
# compiling or tracing: this host's own work, checked before the files above (a compile runs under pjit)
_COMPILING = re.compile(r"(jax/_src/compiler\.py|^(backend_compile|compile_or_get_cached|_cached_compilation)$)")
_INPUT_FUNCS = re.compile(r"(load|read|fetch|next_batch|get_batch|batch|dataloader|data_loader|_next_data|__next__"
                          r"|recv_into|readinto|input|prefetch|iterator|dataset)", re.I)
_INPUT_FILES = re.compile(r"(torch/utils/data|dataloader|grain|tensorflow/python/data|datasets/|webdataset|fsspec"
                          r"|gcsfs|s3fs|(^|/)(io|socket|ssl|selectors)\.py$)", re.I)
# waits that say nothing by themselves: look at who called them
_GENERIC = re.compile(r"(^|/)(threading|queue|time|contextlib|functools)\.py$")
_RANKS_PARENT = re.compile(r"(^|/)tpulaunch/host/ranks\.py$")
# libtpu's own word that a multislice program hangs (its Megascale digest), when it reaches a host log
LIBTPU_HANG = re.compile(r"Megascale hang detected|HANG_DETECTED", re.I)


@dataclass(frozen=True)
class Place:
    """Where one host is: its kind of wait and the frame that says so."""

    kind: str  # COLLECTIVE, INPUT, PYTHON
    frame: str  # "load_batch (train.py:23)"


def main_thread_frames(dump: str) -> list[tuple[str, str]]:
    """The main thread's frames in a `py-spy dump` (of its first process), innermost first:
    (function, file:line). Without a thread named MainThread, the first thread's."""
    lines = dump.splitlines()
    heads = [k for k, line in enumerate(lines) if line.startswith("Thread")]
    start = next((k for k in heads if "MainThread" in lines[k]), heads[0] if heads else None)
    out = []
    for line in lines[(start + 1) if start is not None else 0:]:
        if line.startswith(("Thread", "Process ")):
            break
        m = _FRAME.match(line)
        if m:
            out.append((m.group("func"), f"{m.group('file')}:{m.group('line')}"))
    return out


def _processes(dump: str) -> list[str]:
    """A `py-spy dump --subprocesses` split into its processes' parts (one part when it has no header)."""
    parts: list[list[str]] = []
    for line in dump.splitlines():
        if line.startswith("Process ") or not parts:
            parts.append([])
        parts[-1].append(line)
    return ["\n".join(p) for p in parts] or [dump]


def _short(func: str, where: str) -> str:
    file, _, line = where.rpartition(":")
    return f"{func} ({file.rsplit('/', 1)[-1]}:{line})"


def place_of(dump: str) -> Place:
    """What one host's stacks say it waits for (see the module docstring)."""
    parts = _processes(dump)
    if len(parts) > 1 and any(_RANKS_PARENT.search(w.rpartition(":")[0]) for _f, w in main_thread_frames(parts[0])):
        ranks = [_place_of_process(p) for p in parts[1:]]
        return next((r for r in ranks if r.kind not in (COLLECTIVE, UNKNOWN)), ranks[0])
    return _place_of_process(parts[0])


def _place_of_process(dump: str) -> Place:
    frames = main_thread_frames(dump)
    if not frames:
        said = next((line.strip() for line in dump.splitlines() if line.strip()), "nothing")
        return Place(UNKNOWN, f"no stack: {said[:120]}")
    innermost = True
    for func, where in frames:  # innermost first: the first frame that says what it waits for
        name = func.rsplit(".", 1)[-1]
        file = where.rpartition(":")[0]
        if _GENERIC.search(file):
            continue
        if _COMPILING.search(file) or _COMPILING.search(name):
            return Place(PYTHON, _short(func, where))
        if _COLLECTIVE_FUNCS.match(name) or _COLLECTIVE_FILES.search(file):
            return Place(COLLECTIVE, _short(func, where))
        # an input library's file at any depth; a function named for input only where the host is
        # (a checkpoint saved under `on_batch_end` is not a wait for input)
        if _INPUT_FILES.search(file) or (innermost and _INPUT_FUNCS.search(name)):
            return Place(INPUT, _short(func, where))
        innermost = False
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
    unread = sorted(i for i, p in places.items() if p.kind == UNKNOWN)  # no stack: never named for it
    rest = sorted(i for i in places if i not in waiting and i not in unread)
    hang = _triaged(places, refs, waiting, rest)
    if not unread:
        return hang
    note = f"; no stack from {_hosts_text(unread)} ({places[unread[0]].frame.removeprefix('no stack: ')})"
    return Hang(hang.places, hang.culprits, hang.where, hang.others, hang.line + note, hang.slices)


def _triaged(places: dict[int, Place], refs: dict[int, HostRef], waiting: list[int], rest: list[int]) -> Hang:
    if not waiting and not rest:
        return Hang(places, (), "", "", "hang: no host's stack could be read")
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
    frames = "; ".join(f"{_hosts_text(ps)}: in {f}" for f, ps in _group({i: places[i] for i in rest}).items())
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
