"""TPU VMs through the Cloud TPU API: slices are nodes (made by queued resources), Ray is brought up
over `gcloud ssh` (`cluster.remote`), and a preempted slice is deleted and made again from its
queued resource (`provision.capacity`), set up and joined to the same head.

On Cloud TPU nothing revives a preempted spot slice: its queued resource goes SUSPENDED (or its
node PREEMPTED) until someone deletes and re-creates it. A slice the API calls preempted (node
PREEMPTED / TERMINATED / gone, queued resource SUSPENDING / SUSPENDED / FAILED) is made again
within `--preemption-wait`; a slice the API still calls READY lost a node for another reason:
nothing is re-created (the plain wait for the slice in Ray). The unit of re-creation is the queued
resource: slices of one multislice queued resource are suspended together by the service, so they
are made again together.
"""

from __future__ import annotations

import time

from tpulaunch.cluster.record import ClusterInfo, save_record
from tpulaunch.errors import LaunchError, TpulaunchError
from tpulaunch.plan.slicespec import SliceSpec
from tpulaunch.providers.base import Progress, Provider, Recreation, RejoinFailed, Say, status_doc

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


def refusal(cluster: ClusterInfo) -> str | None:
    """Why `--recreate` cannot work on a cluster of TPU VMs. Pure."""
    remote = cluster.remote
    if remote is None:
        return ("--recreate needs a cluster brought up by `tpulaunch cluster up --tpu NAME --head local`"
                " (none is recorded)")
    if not remote.head_here:
        return (f"--recreate with the Ray head on worker 0 of '{remote.tpu}': the head would be preempted with the"
                " slice. bring the cluster up with `tpulaunch cluster up --tpu NAME --head local`")
    return None


def qr_id(spec: SliceSpec) -> str:
    """The id of the queued resource that made the slice ("" for none)."""
    return (spec.queued_resource or "").rsplit("/", 1)[-1]


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


class TpuVmProvider(Provider):
    """A cluster of `cluster up --tpu A [--tpu B ...]`."""

    kind = "tpu-vm"

    def status(self) -> dict:
        """What the head says of its nodes, asked over ssh to worker 0 (Ray's ports are internal to the
        slice) or here when the head is."""
        from tpulaunch.cluster.remote import RemoteCluster
        from tpulaunch.discover import ray_labels
        from tpulaunch.errors import ClusterError

        cluster = RemoteCluster.of(self.info)
        q = cluster.status_query()
        if not q["head"]:
            raise ClusterError(f"the Ray head of TPU '{cluster.names[0]}' ({self.info.address}) does not answer",
                               "start it again with `tpulaunch cluster up --tpu ...`")
        nodes = q["nodes"]
        free = {n["NodeID"]: n["Available"] for n in nodes if n.get("Available") is not None}
        found = ray_labels.slices_from_nodes(nodes, free)
        return status_doc(self.info, found)

    def down(self, progress: Progress) -> dict:
        """This cluster's Ray processes on every worker (and the head here); ClusterError naming the
        workers where that failed, the record kept for a second try."""
        from pathlib import Path

        from tpulaunch.cluster import tokens
        from tpulaunch.cluster.record import clear_record
        from tpulaunch.cluster.remote import RemoteCluster
        from tpulaunch.errors import ClusterError

        rec = self.info
        cluster = RemoteCluster.of(rec)
        results = cluster.down(lambda name: lambda w, state: progress.host(name, w, state))
        bad = {w: (r.get("error") or f"{len(r['left'])} process(es) left") for w, r in results.items()
               if r.get("error") or r.get("left")}
        if bad:
            head = results.get("head")
            here = (" (the head here is stopped)" if head is not None and not head.get("error") and not head.get("left")
                    else "")
            raise ClusterError("could not stop Ray on " + "; ".join(f"worker {w}: {m}" for w, m in sorted(bad.items()))
                               + here,
                               "fix what that says (gcloud login, config) and run `tpulaunch cluster down` again:"
                               " the record is kept for it")
        deleted = []
        remote = rec.remote
        if remote is not None:
            for name in remote.made:  # the spare slices `cluster up` made
                from tpulaunch.provision import capacity

                progress.note(f"deleting slice {name} (made by cluster up)")
                if capacity.delete(remote.project, remote.zone, name):
                    deleted.append(name)
        clear_record()
        if rec.token_path and tokens.is_ours(rec.token_path):
            Path(rec.token_path).unlink(missing_ok=True)
        return {"processes_stopped": sum(r.get("stopped", 0) for r in results.values()),
                "hosts": dict(sorted(results.items())), "deleted_slices": deleted}

    def recreate_refusal(self) -> str | None:
        return refusal(self.info)

    def check_recreate(self) -> None:
        """Every slice has a queued resource to make it again (the API's word; credentials included)."""
        from tpulaunch import discover

        r = self.info.remote
        assert r is not None  # refusal() said so
        for s in self.info.slices:
            spec = discover.describe_node(s.name, zone=r.zone, project=r.project)
            if not spec.queued_resource:
                raise LaunchError(f"TPU '{spec.name}' was not created through a queued resource: nothing records how"
                                  " to make it again", "create it with `tpulaunch slice create NAME ... --spot`, or run"
                                  " without --recreate")

    def preempted(self, slices: list[str]) -> dict[str, str | None]:
        r = self.info.remote
        specs = {s.name: s for s in self.info.slices}
        out: dict[str, str | None] = {}
        for name in slices:
            if r is None or name not in specs:
                out[name] = None
                continue
            try:
                out[name] = preempted(specs[name], r.project, r.zone)[1]
            except TpulaunchError:
                out[name] = None
        return out

    def bring_back(self, lost: list[str], deadline_s: float, say: Say) -> tuple[list[Recreation], list[SliceSpec]]:
        """Ask the API about each slice in `lost`; re-create, set up and rejoin the preempted ones."""
        from tpulaunch.provision import capacity

        cluster = self.info
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
                self._rejoin([specs[i].name for i in members], end - time.monotonic(), say)
            except RejoinFailed as e:
                rec.join_failures.append(e.why)
                e.made = done
                raise
            finally:
                rec.steps["setup_join_s"] = time.monotonic() - t
        return done, list(cluster.slices)

    def rejoin(self, lost: list[str], deadline_s: float, say: Say) -> list[SliceSpec]:
        return self._rejoin(lost, deadline_s, say, again=True)

    def replace_refusal(self) -> str | None:
        return refusal(self.info)

    def repair(self, deadline_s: float, say: Say) -> list[str]:
        """Each slice not whole in Ray: a queued resource already asked again (a stopped run's
        re-creation) is waited for until ACTIVE, then set up and joined; a preempted one is made
        again; a READY one's missing workers join again."""
        from tpulaunch.provision import capacity

        r = self.info.remote
        assert r is not None
        missing = self.not_whole()
        end = time.monotonic() + deadline_s
        for name in sorted(missing):
            spec = next(s for s in self.info.slices if s.name == name)
            qr = qr_id(spec)
            st = capacity.get(r.project, r.zone, qr) if qr else None
            say(f"slice {name}: {missing[name]}; queued resource {qr or '-'} {st.state if st else 'gone'}")
            if st is not None and st.state in capacity.WAITING:
                capacity.wait_active(r.project, r.zone, qr, max(1.0, end - time.monotonic()), say,
                                     flag="--timeout")
                self._rejoin([name], max(1.0, end - time.monotonic()), say)
            elif preempted(spec, r.project, r.zone)[1] is not None:
                self.bring_back([name], max(1.0, end - time.monotonic()), say)
            else:
                self._rejoin([name], max(1.0, end - time.monotonic()), say, again=True)
        return sorted(missing)

    def replace(self, names: list[str], why: str, deadline_s: float,
                say: Say) -> tuple[list[Recreation], list[SliceSpec]]:
        """Delete and create again the queued resources of these slices (new VMs), set them up and join."""
        from tpulaunch.provision import capacity

        cluster = self.info
        assert cluster.remote is not None
        end = time.monotonic() + deadline_s
        done: list[Recreation] = []
        for spec in [s for s in cluster.slices if s.name in names]:
            qr = qr_id(spec)
            if not qr:
                raise LaunchError(f"slice {spec.name} has no queued resource to make it again", "")
            say(f"slice {spec.name}: {why}: making it again (queued resource {qr})")
            rec = Recreation(spec.name, qr, why)
            _st, took = capacity.recreate(cluster.remote.project, cluster.remote.zone, qr,
                                          max(1.0, end - time.monotonic()), say)
            rec.steps.update(took)
            done.append(rec)
            t = time.monotonic()
            try:
                self._rejoin([spec.name], end - time.monotonic(), say)
            finally:
                rec.steps["setup_join_s"] = time.monotonic() - t
        return done, list(cluster.slices)

    def preempted_again(self, lost: list[str]) -> bool:
        """The API's word, its errors included (a comeback it cannot ask about ends)."""
        r = self.info.remote
        assert r is not None  # --recreate is refused without a remote cluster
        return any(preempted(s, r.project, r.zone)[1] is not None for s in self.info.slices if s.name in lost)

    def _rejoin(self, names: list[str], deadline_s: float, say: Say, *, again: bool = False) -> list[SliceSpec]:
        """Set up the (new) VMs of these slices and join them to the head; the record follows them.
        `again`: a join of the same new VMs after one that failed. The first waited for Ray to let go
        of the old VMs' nodes, so the slice's nodes Ray has now are new VMs that did join: they are
        kept and only the others join (waiting for them to go would wait out the whole preemption
        wait). Raises RejoinFailed."""
        from tpulaunch import discover
        from tpulaunch.cluster.remote import RemoteCluster

        cluster = self.info
        assert cluster.remote is not None
        end = time.monotonic() + deadline_s
        for i, spec in enumerate(list(cluster.slices)):
            if spec.name not in names:
                continue
            try:
                fresh = discover.describe_node(spec.name, zone=cluster.remote.zone, project=cluster.remote.project)
                say(f"slice {spec.name}: ACTIVE again ({len(fresh.workers)} workers): setting up and joining the head")

                def host_progress(w: int, s: str, name: str = spec.name) -> None:
                    say(f"slice {name} worker {w}: {s}")

                # the head is off the slices (`refusal`): its address stays, only the workers are new
                RemoteCluster.of(cluster).rejoin(cluster, i, fresh, host_progress,
                                                 max(1.0, end - time.monotonic()), replaced=not again)
            except TpulaunchError as e:
                raise RejoinFailed(e.line()) from None
        save_record(cluster)  # the record follows the new VMs (status, down, the next re-creation)
        return list(cluster.slices)
