"""`--recreate`: a preempted slice is made again, set up, joined to the same head, and the run goes on.

On Cloud TPU nothing revives a preempted spot slice: its queued resource goes SUSPENDED (or its
node PREEMPTED) until someone deletes and re-creates it. With `--recreate`, when an attempt lost
hosts the run asks the Cloud TPU API what happened to their slices; a slice the API calls
preempted (node PREEMPTED / TERMINATED / gone, queued resource SUSPENDING / SUSPENDED / FAILED) is
deleted and created again from the spec its queued resource holds, waited for until ACTIVE, its
workers set up (`cluster up --setup`) and joined to the same Ray head, all within
`--preemption-wait`; then the next attempt runs on the new VMs. A slice the API still calls
READY lost a node for another reason: nothing is re-created (the plain wait for the slice).

`must_recreate` and `refusal` are the rules (pure); `bring_back` carries them out once and
`Comeback` again while the wait allows: new VMs that could not be set up or joined (slow to start
Ray on a loaded machine) are joined again, a slice preempted again before it was back is made again
(a preemption more, while the run's budget has one).
"""

from __future__ import annotations

import time
from typing import Callable

from tpulaunch.cluster.record import ClusterInfo, save_record
from tpulaunch.errors import LaunchError, TpulaunchError
from tpulaunch.plan.slicespec import SliceSpec
from tpulaunch.run.summary import Recreation

PREEMPTED_NODE = ("PREEMPTED", "TERMINATED", "STOPPED", "STOPPING", "DELETING")
PREEMPTED_QR = ("SUSPENDING", "SUSPENDED", "FAILED", "DELETING")


def must_recreate(node_state: str | None, qr_state: str | None) -> str | None:
    """Why the slice must be made again (None: it was not preempted; a plain node loss). Pure."""
    if node_state is None:
        return f"its node is gone (queued resource {qr_state or 'gone'})"
    if node_state in PREEMPTED_NODE:
        return f"its node is {node_state}"
    if qr_state in PREEMPTED_QR:
        return f"its queued resource is {qr_state}"
    return None


def refusal(cluster: ClusterInfo | None, emulated: bool) -> str | None:
    """Why `--recreate` cannot work for a run on `cluster` (checked before anything starts). Pure."""
    if emulated or cluster is None or cluster.emulated:
        return ("--recreate makes real slices again through the Cloud TPU API; an emulated slice's lost hosts are"
                " started again without it")
    remote = cluster.remote
    if remote is None:
        return "--recreate needs a cluster brought up by `tpulaunch cluster up --tpu NAME --head local` (none is recorded)"
    if not remote.head_here:
        return (f"--recreate with the Ray head on worker 0 of '{remote.tpu}': the head would be preempted with the"
                " slice. bring the cluster up with `tpulaunch cluster up --tpu NAME --head local`")
    return None


def check(cluster: ClusterInfo | None, emulated: bool, max_preemptions: int) -> None:
    """Refuse (one line) a `--recreate` that cannot work, before anything starts: the rules
    (`refusal`), a budget, and the API's word that the slice has a queued resource to make again
    (credentials included)."""
    from tpulaunch import discover

    why = refusal(cluster, emulated)
    if why:
        raise LaunchError(why, "")
    if not max_preemptions:
        raise LaunchError("--recreate without --max-preemptions: no preemption would be survived",
                          "add --max-preemptions N (each re-creation counts as one)")
    assert cluster is not None and cluster.remote  # refusal() said so
    r = cluster.remote
    for s in cluster.slices:
        spec = discover.describe_node(s.name, zone=r.zone, project=r.project)
        if not spec.queued_resource:
            raise LaunchError(f"TPU '{spec.name}' was not created through a queued resource: nothing records how to"
                              " make it again", "create it with `tpulaunch slice create NAME ... --spot`, or run without"
                              " --recreate")


def in_run_order(run: tuple[SliceSpec, ...] | list[SliceSpec], now: list[SliceSpec]) -> list[SliceSpec]:
    """The run's slices as the cluster holds them `now` (new VMs of re-created ones), each keeping
    its place in the run (`slice_index`): a run may use some of a cluster's slices, in its own order.
    Pure."""
    from dataclasses import replace

    by_name = {s.name: s for s in now}
    return [replace(by_name.get(s.name, s), slice_index=s.slice_index) for s in run]


def qr_id(spec: SliceSpec) -> str:
    """The id of the queued resource that made the slice ("" for none)."""
    return (spec.queued_resource or "").rsplit("/", 1)[-1]


class RejoinFailed(TpulaunchError):
    """A slice was made again but its new VMs could not be set up or joined (slow to start Ray, or
    preempted again before they were)."""

    def __init__(self, why: str) -> None:
        super().__init__(f"the re-created slice could not join: {why}", "see the slice's workers (`cluster status`)")
        self.why = why
        self.made: list[Recreation] = []  # set by bring_back: the slices it made, this one included


def preempted(spec: SliceSpec, project: str, zone: str) -> tuple[str | None, str | None]:
    """(the node's state, why the slice must be made again or None), as the Cloud TPU API says now."""
    from tpulaunch import discover
    from tpulaunch.errors import NodeNotFoundError
    from tpulaunch.provision import capacity

    qr = qr_id(spec)
    try:
        node_state = discover.describe_node(spec.name, zone=zone, project=project).state
    except NodeNotFoundError:
        node_state = None
    qr_state = (capacity.get(project, zone, qr) or capacity.QrState(qr, "gone")).state if qr else None
    return node_state, must_recreate(node_state, qr_state)


def bring_back(cluster: ClusterInfo, lost: list[str], deadline_s: float,
               say: Callable[[str], None]) -> tuple[list[Recreation], list[SliceSpec]]:
    """Ask the API about each slice in `lost`; re-create, set up and rejoin the preempted ones.
    Returns what was re-created and the cluster's slices as they are now (new addresses).

    The unit of re-creation is the queued resource: slices made by their own queued resources
    come back one by one (the others keep running); the slices of one multislice queued resource
    are suspended together by the service, so they are made again together."""
    from tpulaunch.provision import capacity

    end = time.monotonic() + deadline_s
    assert cluster.remote is not None  # refusal() said so before the run started
    project, zone = cluster.remote.project, cluster.remote.zone
    specs = list(cluster.slices)
    done: list[Recreation] = []
    seen: set[str] = set()
    for spec in specs:
        qr = qr_id(spec)
        if spec.name not in lost or (qr and qr in seen):
            continue
        seen.add(qr)
        node_state, why = preempted(spec, project, zone)
        if why is None:
            say(f"slice {spec.name}: the Cloud TPU API says it is {node_state}: a node was lost, not the slice;"
                " waiting for it in Ray")
            continue
        if not qr:
            raise LaunchError(f"slice {spec.name} was preempted ({why}) but has no queued resource to re-create",
                              "re-create it yourself and run `tpulaunch cluster up --tpu` again")
        members = [i for i, s in enumerate(specs) if qr_id(s) == qr]
        names = ", ".join(specs[i].name for i in members)
        say(f"slice {names}: {why}: re-creating it (queued resource {qr})")
        rec = Recreation(names, qr, why)
        _st, took = capacity.recreate(project, zone, qr, max(1.0, end - time.monotonic()), say)
        rec.steps.update(took)
        t = time.monotonic()
        done.append(rec)
        try:
            rejoin(cluster, [specs[i].name for i in members], end - time.monotonic(), say)
        except RejoinFailed as e:
            rec.join_failures.append(e.why)
            e.made = done
            raise
        finally:
            rec.steps["setup_join_s"] = time.monotonic() - t
    return done, list(cluster.slices)


class Comeback:
    """`bring_back` of the slices in `lost`, done again while `deadline_s` allows.

    A set-up or join that fails leaves the slice made: if the Cloud TPU API says it was preempted
    again, it is made again (one of `budget` more preemptions, counted in `again`), else its VMs
    are set up and joined again (a VM slow to start Ray). `made` lists every re-creation as it
    happens, so a caller sees them even when `run` raises."""

    def __init__(self, cluster: ClusterInfo, lost: list[str], say: Callable[[str], None], *, budget: int,
                 stopped: Callable[[], bool] = lambda: False, pause: Callable[[float], object] = time.sleep) -> None:
        self.cluster, self.lost, self.say, self.budget = cluster, lost, say, budget
        self.stopped, self.pause = stopped, pause
        self.made: list[Recreation] = []
        self.again = 0

    def run(self, deadline_s: float) -> list[SliceSpec]:
        """The cluster's slices once the lost ones are back. Raises RejoinFailed (or the API's error)."""
        end = time.monotonic() + deadline_s
        names = ", ".join(self.lost)
        joining: list[Recreation] = []  # made again, their VMs not set up and joined yet
        while True:
            left = max(1.0, end - time.monotonic())
            t = time.monotonic()
            try:
                if not joining:
                    recs, slices = self.bring_back(left)
                    self.made.extend(recs)
                    return slices
                try:
                    return self.rejoin(left)
                finally:
                    for rec in joining:
                        rec.steps["setup_join_s"] = rec.steps.get("setup_join_s", 0.0) + time.monotonic() - t
            except RejoinFailed as e:
                if joining:
                    for rec in joining:
                        rec.join_failures.append(e.why)
                else:
                    self.made.extend(e.made)
                    joining = [rec for rec in e.made if rec.join_failures]
                if self.stopped() or time.monotonic() >= end:
                    raise
                if not self.preempted_again():
                    self.say(f"slice(s) {names} not back yet ({e.line()}): joining them again")
                    self.pause(2.0)
                    continue
                joining = []
                if self.again >= self.budget:
                    raise
                self.again += 1
                self.say(f"slice(s) {names} lost again while being brought back ({e.line()}):"
                         f" making them again (preemption {self.again} of the {self.budget} left)")

    # the steps, one call each to the Cloud TPU API and the VMs
    def bring_back(self, deadline_s: float) -> tuple[list[Recreation], list[SliceSpec]]:
        return bring_back(self.cluster, self.lost, deadline_s, self.say)

    def rejoin(self, deadline_s: float) -> list[SliceSpec]:
        return rejoin(self.cluster, self.lost, deadline_s, self.say, again=True)

    def preempted_again(self) -> bool:
        """Does the Cloud TPU API say a lost slice must be made again (preempted while it came back)?"""
        remote = self.cluster.remote
        assert remote is not None  # --recreate is refused without a remote cluster
        return any(preempted(s, remote.project, remote.zone)[1] is not None
                   for s in self.cluster.slices if s.name in self.lost)


def rejoin(cluster: ClusterInfo, names: list[str], deadline_s: float, say: Callable[[str], None], *,
           again: bool = False) -> list[SliceSpec]:
    """Set up the (new) VMs of these slices and join them to the head; the record follows them.
    `again`: a join of the same new VMs after one that failed. The first waited for Ray to let go
    of the old VMs' nodes, so the slice's nodes Ray has now are new VMs that did join: they are kept
    and only the others join (waiting for them to go would wait out the whole preemption wait).
    Returns the cluster's slices as they are now. Raises RejoinFailed."""
    from tpulaunch import discover
    from tpulaunch.cluster.remote import RemoteCluster

    assert cluster.remote is not None
    end = time.monotonic() + deadline_s
    for i, spec in enumerate(list(cluster.slices)):
        if spec.name not in names:
            continue
        try:
            fresh = discover.describe_node(spec.name, zone=cluster.remote.zone, project=cluster.remote.project)
            say(f"slice {spec.name}: ACTIVE again ({len(fresh.workers)} workers): setting up and joining the head")
            # the head is off the slices (`refusal`): its address stays, only the workers are new
            RemoteCluster.of(cluster).rejoin(cluster, i, fresh,
                                             lambda w, s, name=spec.name: say(f"slice {name} worker {w}: {s}"),
                                             max(1.0, end - time.monotonic()), replaced=not again)
        except TpulaunchError as e:
            raise RejoinFailed(e.line()) from None
    save_record(cluster)  # the record follows the new VMs (status, down, the next re-creation)
    return list(cluster.slices)
