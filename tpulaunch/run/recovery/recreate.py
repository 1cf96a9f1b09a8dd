"""`--recreate`: a preempted slice is made again, set up, joined to the same head, and the run goes on.

When an attempt lost hosts, the run asks the cluster's provider (`tpulaunch.providers`) what
happened to their slices: the Cloud TPU API for TPU VMs (a preempted spot slice is deleted and
made again from its queued resource), the Kubernetes API on GKE (KubeRay makes the slice's replica
again once GKE has its node pool back). A slice the provider does not call preempted lost a host
for another reason: nothing is made again (the plain wait for the slice in Ray).

`check` refuses up front what cannot work; `Comeback` carries a comeback out and again while the
wait allows: new hosts that could not join (slow to start Ray on a loaded machine) are joined
again, a slice preempted again before it was back is made again (a preemption more, while the run's
budget has one). The provider does each step; this module only decides when.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from tpulaunch import providers
from tpulaunch.cluster.record import ClusterInfo
from tpulaunch.errors import LaunchError, TpulaunchError
from tpulaunch.plan.slicespec import SliceSpec
from tpulaunch.providers import Recreation, RejoinFailed

__all__ = ["Comeback", "Recreation", "RejoinFailed", "check", "check_replace", "in_run_order"]


def check(cluster: ClusterInfo | None, emulated: bool, max_preemptions: int) -> None:
    """Refuse (one line) a `--recreate` that cannot work, before anything starts: the provider's
    rules, a budget, and the provider's API's word that every slice can be made again."""
    provider = providers.of(None if emulated else cluster)
    why = provider.recreate_refusal()
    if why:
        raise LaunchError(why, "")
    if not max_preemptions:
        raise LaunchError("--recreate without --max-preemptions: no preemption would be survived",
                          "add --max-preemptions N (each re-creation counts as one)")
    provider.check_recreate()


def check_replace(cluster: ClusterInfo | None, local: bool, max_restarts: int, min_slices: int | None) -> None:
    """Refuse (one line) a `--replace-hung` that could never replace anything, before anything starts."""
    if not max_restarts:
        raise LaunchError("--replace-hung without --max-restarts: a replacement counts as a restart",
                          "add --max-restarts N")
    if local or min_slices:
        return  # an emulated cluster here starts a slice's hosts again; --min-slices drops the slice
    why = providers.of(cluster).replace_refusal()
    if why:
        raise LaunchError(f"--replace-hung: {why}, and no --min-slices lets the run drop a hung slice",
                          "bring the cluster up with `tpulaunch cluster up --tpu NAME --head local` or `--gke`, or add"
                          " --min-slices K")


def in_run_order(run: tuple[SliceSpec, ...] | list[SliceSpec], now: list[SliceSpec]) -> list[SliceSpec]:
    """The run's slices as the cluster holds them `now` (new hosts of re-created ones), each keeping
    its place in the run (`slice_index`): a run may use some of a cluster's slices, in its own order.
    Pure."""
    from dataclasses import replace

    by_name = {s.name: s for s in now}
    return [replace(by_name.get(s.name, s), slice_index=s.slice_index) for s in run]


class Comeback:
    """The provider's `bring_back` of the slices in `lost`, done again while `deadline_s` allows.

    A set-up or join that fails leaves the slice made: if the provider says it was preempted again,
    it is made again (one of `budget` more preemptions, counted in `again`), else its hosts are
    joined again (a host slow to start Ray). `made` lists every re-creation as it happens, so a
    caller sees them even when `run` raises."""

    def __init__(self, cluster: ClusterInfo, lost: list[str], say: Callable[[str], None], *, budget: int,
                 stopped: Callable[[], bool] = lambda: False, pause: Callable[[float], object] = time.sleep) -> None:
        self.cluster, self.lost, self.say, self.budget = cluster, lost, say, budget
        self.provider = providers.of(cluster)
        self.stopped, self.pause = stopped, pause
        self.made: list[Recreation] = []
        self.again = 0

    def run(self, deadline_s: float) -> list[SliceSpec]:
        """The cluster's slices once the lost ones are back. Raises RejoinFailed (or the API's error)."""
        end = time.monotonic() + deadline_s
        names = ", ".join(self.lost)
        joining: list[Recreation] = []  # made again, their hosts not set up and joined yet
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

    # the steps, each the provider's
    def bring_back(self, deadline_s: float) -> tuple[list[Recreation], list[SliceSpec]]:
        return self.provider.bring_back(self.lost, deadline_s, self.say)

    def rejoin(self, deadline_s: float) -> list[SliceSpec]:
        return self.provider.rejoin(self.lost, deadline_s, self.say)

    def preempted_again(self) -> bool:
        """Does the provider say a lost slice must be made again (preempted while it came back)?"""
        return self.provider.preempted_again(self.lost)


def preempted_slices(cluster: ClusterInfo, names: list[str]) -> dict[str, str | None]:
    """Per slice, why its provider says it was preempted (None: it does not say so); never raises."""
    try:
        return providers.of(cluster).preempted(names)
    except TpulaunchError:
        return {n: None for n in names}
