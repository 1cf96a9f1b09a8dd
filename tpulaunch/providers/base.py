"""The seam every place slices come from sits behind: one `Provider` per kind of cluster.

What run/ and cli/ need of a cluster that differs by where its slices come from is asked of its
provider, never of a concrete API: where this machine reaches the cluster's job API, what the
cluster holds now (`status`), how it is taken down, and recovery: whether a lost slice was
preempted (the provider's own word: the Cloud TPU API, the Kubernetes API), how it comes back
(`bring_back`, `rejoin`), and why `--recreate` cannot work on it. Bringing a cluster up takes
different facts on each (a TPU's name, a node pool's shape), so each provider module has its own
`up`; everything after it is the same code for all.

`Recreation` and `RejoinFailed` are the records and the error of a comeback, whatever brings it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from tpulaunch.cluster.record import ClusterInfo
from tpulaunch.errors import TpulaunchError
from tpulaunch.plan.slicespec import SliceSpec

Say = Callable[[str], None]


@dataclass
class Recreation:
    """One slice made again after an attempt (`--recreate`): what the provider said, and how long
    each step took (seconds, rounded to 0.01 where the summary is written)."""

    slice: str
    queued_resource: str  # the queued resource it was made from ("" where there is none)
    why: str  # node PREEMPTED, queued resource SUSPENDED, node gone, pods ended by a node shutdown ...
    steps: dict[str, float] = field(default_factory=dict)  # delete_s, create_s, provision_s, setup_join_s, ray_whole_s
    join_failures: list[str] = field(default_factory=list)  # each set-up or join of its new VMs that failed
    replica: str | None = None  # GKE: the KubeRay replica that came back in its place

    def to_dict(self) -> dict:
        doc = {"slice": self.slice, "queued_resource": self.queued_resource, "why": self.why,
               "steps": {k: round(v, 2) for k, v in self.steps.items()}, "join_failures": list(self.join_failures)}
        if self.replica is not None:
            doc["replica"] = self.replica
        return doc

    @staticmethod
    def from_dict(d: dict) -> Recreation:
        return Recreation(d["slice"], d.get("queued_resource", ""), d.get("why", ""), dict(d.get("steps") or {}),
                          list(d.get("join_failures") or ()), d.get("replica"))


class RejoinFailed(TpulaunchError):
    """A slice was made again but its new hosts could not be set up or joined (slow to start Ray,
    or preempted again before they were)."""

    def __init__(self, why: str) -> None:
        super().__init__(f"the re-created slice could not join: {why}", "see the slice's workers (`cluster status`)")
        self.why = why
        self.made: list[Recreation] = []  # set by bring_back: the slices it made, this one included


class Progress(Protocol):
    """What a long operation on a cluster says as it goes (the CLI renders it)."""

    def host(self, slice_name: str, worker: int, state: str) -> None:
        """One host's state (worker -1: a head off the slices)."""

    def note(self, text: str) -> None:
        """A line about the whole cluster."""


class Provider:
    """One cluster's provider. The defaults are a cluster nothing can make again (a Ray cluster
    joined by address): subclasses say what theirs can do."""

    kind = "ray"

    def __init__(self, info: ClusterInfo) -> None:
        self.info = info

    # -- reaching it --------------------------------------------------------------------------------

    def job_url(self) -> str | None:
        """Where this machine reaches the cluster's job API, when the provider knows (None: ask the record)."""
        return None

    def supervisor_env(self) -> dict[str, str]:
        """What a detached run's supervisor on the head needs to find this provider there."""
        return {}

    # -- spare slices ---------------------------------------------------------------------------------

    def spares(self) -> list[str]:
        """The cluster's spare slices (joined to Ray, held in reserve), as its record keeps them."""
        return list(self.info.spares) if self.info is not None else []

    def swap(self, lost: str, spare: str) -> None:
        """`spare` takes `lost`'s place in the runs; `lost`, once back, is the spare: the record says so."""
        from tpulaunch.cluster.record import save_record

        self.info.spares = [lost if s == spare else s for s in self.info.spares]
        if self.info.remote is not None or (self.info.emulated and self.info.cluster_id):
            save_record(self.info)

    # -- what it holds, and its end ------------------------------------------------------------------

    def status(self) -> dict:
        """Each slice the cluster has, its hosts, which are alive and busy (`cluster status --json`)."""
        from tpulaunch.cluster.connect import connect, disconnect
        from tpulaunch.discover import ray_labels

        connect(self.info)  # before Ray is imported: it reads its auth settings from the env
        try:
            found = ray_labels.read_slices()
        finally:
            disconnect()
        return status_doc(self.info, found)

    def down(self, progress: Progress) -> dict:
        """Stop (or delete) what tpulaunch started for this cluster; what was done (`cluster down --json`)."""
        from tpulaunch.errors import ClusterError

        raise ClusterError(f"the cluster at {self.info.address} was not started by tpulaunch here",
                           "stop it where it was started")

    def not_whole(self, status: dict | None = None) -> dict[str, str]:
        """The cluster's slices not whole in Ray now: name -> how many of its hosts are (from `status`)."""
        doc = status if status is not None else self.status()
        seen = {s["name"]: s for s in doc.get("slices", [])}
        out = {}
        for spec in self.info.slices:
            hosts = (seen.get(spec.name) or {}).get("hosts") or []
            alive = sum(1 for h in hosts if h.get("alive"))
            if alive < len(spec.workers):
                out[spec.name] = f"{alive} of {len(spec.workers)} hosts in Ray"
        return out

    def repair(self, deadline_s: float, say: Say) -> list[str]:
        """Bring back every slice of the cluster that is not whole (a re-creation a stopped run left
        half done, a VM that went); the slices repaired. A re-creation belongs to the cluster, not
        to the run that started it."""
        missing = self.not_whole()
        if not missing:
            return []
        for name, why in missing.items():
            say(f"slice {name}: {why}: bringing it back")
        self.bring_back(sorted(missing), deadline_s, say)
        return sorted(missing)

    # -- recovery -----------------------------------------------------------------------------------

    def recreate_refusal(self) -> str | None:
        """Why `--recreate` cannot work on this cluster (None: it can). Pure."""
        return ("--recreate needs a cluster that can make a slice again: `tpulaunch cluster up --tpu NAME --head local`"
                " (Cloud TPU) or `tpulaunch cluster up --gke` (GKE)")

    def check_recreate(self) -> None:
        """Ask the provider's API, before anything starts, that every slice can be made again."""

    def preempted(self, slices: list[str]) -> dict[str, str | None]:
        """For each slice name: why the provider says it was lost to a preemption, or None."""
        return {s: None for s in slices}

    def bring_back(self, lost: list[str], deadline_s: float, say: Say) -> tuple[list[Recreation], list[SliceSpec]]:
        """Make the preempted ones of `lost` again and join them; (what was made, the cluster's slices now)."""
        raise RejoinFailed("this cluster's slices cannot be made again from here")

    def rejoin(self, lost: list[str], deadline_s: float, say: Say) -> list[SliceSpec]:
        """Join again the new hosts of slices made but not yet joined; the cluster's slices now."""
        raise RejoinFailed("this cluster's slices cannot be joined again from here")

    def preempted_again(self, lost: list[str]) -> bool:
        """Were any of `lost` preempted again while they came back?"""
        return any(self.preempted(lost).values())

    def replace_refusal(self) -> str | None:
        """Why a slice of this cluster cannot be taken out and made again (`--replace-hung`). Pure."""
        return "a cluster known only by its address cannot make a slice again"

    def replace(self, names: list[str], why: str, deadline_s: float,
                say: Say) -> tuple[list[Recreation], list[SliceSpec]]:
        """Take these (healthy but hung) slices out and make them again: new hosts with the same
        identity; (what was made, the cluster's slices now)."""
        raise RejoinFailed(self.replace_refusal() or "not supported")


def status_doc(info: ClusterInfo, found: list) -> dict:
    """`cluster status --json` of slices Ray's TPU labels show (`ray_labels.RaySlice`)."""
    return {
        "schema": "tpulaunch.cluster-status/v1", "address": info.address, "emulated": info.emulated,
        "slices": [
            {"name": s.name, "pod_type": s.pod_type, "topology": s.topology,
             "hosts": [{"worker_id": w, "node_ip": ip, "alive": alive, "busy": busy}
                       for w, ip, alive, busy in s.workers]}
            for s in found
        ],
    }
