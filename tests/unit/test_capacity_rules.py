"""Slice creation as data (`provision.capacity`: the request body against the REST reference) and the
rules of `--recreate` (`run.recovery.recreate`: when a slice must be made again, when the flag is refused, what
is tried again when its new VMs cannot join), and a plan moved onto a re-created slice's new addresses
(`LaunchPlan.on_slices`)."""

from __future__ import annotations

import json

import pytest

from tpulaunch.cluster.record import ClusterInfo, RemoteSpec
from tpulaunch.provision.capacity import SliceOrder, check_order, queued_resource_body
from tpulaunch.errors import ExitCode, LaunchError
from tpulaunch.plan.launch import build_plan
from tpulaunch.plan.mesh import plan_mesh
from tpulaunch.plan.slicespec import SliceSpec, WorkerEndpoint
from tpulaunch.plan.topology import resolve
from tpulaunch import providers
from tpulaunch.providers.tpu_vm import must_recreate, qr_id
from tpulaunch.run.recovery.recreate import Comeback, Recreation, RejoinFailed, in_run_order

P = "projects/p/locations/us-central2-b"


def order(**kw) -> SliceOrder:
    base = dict(name="my-slice", project="p", zone="us-central2-b", accelerator_type="v4-16")
    return check_order(SliceOrder(**{**base, **kw}))


def test_a_spot_slice_by_accelerator_type():
    assert queued_resource_body(order(tier="spot")) == {
        "tpu": {"nodeSpec": [{"parent": P, "nodeId": "my-slice", "node": {
            "runtimeVersion": "tpu-ubuntu2204-base", "acceleratorType": "v4-16", "schedulingConfig": {"spot": True},
            "networkConfig": {"enableExternalIps": True}}}]},
        "spot": {},
    }


def test_a_reserved_slice_by_topology_with_its_generations_runtime():
    body = queued_resource_body(order(accelerator_type="v5p", topology="2x2x4", tier="reserved"))
    node = body["tpu"]["nodeSpec"][0]["node"]
    assert node == {"runtimeVersion": "v2-alpha-tpuv5", "acceleratorConfig": {"type": "V5P", "topology": "2x2x4"},
                    "networkConfig": {"enableExternalIps": True}}  # always sent, as gcloud sends it
    assert body["reservationName"] == f"{P}/reservations/-" and "spot" not in body


def test_guaranteed_multislice_with_network_and_runtime():
    body = queued_resource_body(order(accelerator_type="v6e-16", num_slices=3, tier="guaranteed",
                                      runtime_version="v2-alpha-tpuv6e-custom", network="n1", subnetwork="s1"))
    spec = body["tpu"]["nodeSpec"][0]
    assert spec["multisliceParams"] == {"nodeCount": 3, "nodeIdPrefix": "my-slice"} and "nodeId" not in spec
    assert spec["node"]["networkConfig"] == {"network": "n1", "subnetwork": "s1", "enableExternalIps": True}
    internal = queued_resource_body(order(accelerator_type="v6e-16", network="n1", internal_ips=True))
    assert internal["tpu"]["nodeSpec"][0]["node"]["networkConfig"] == {"network": "n1", "enableExternalIps": False}
    assert spec["node"]["runtimeVersion"] == "v2-alpha-tpuv6e-custom" and body["guaranteed"] == {}
    assert order(num_slices=3).node_names() == ["my-slice-0", "my-slice-1", "my-slice-2"]


def test_on_demand_sends_no_tier():
    body = queued_resource_body(order())
    assert set(body) == {"tpu"} and "schedulingConfig" not in body["tpu"]["nodeSpec"][0]["node"]


@pytest.mark.parametrize("kw, says", [
    ({"name": "My_Slice"}, "not a name the Cloud TPU API accepts"),
    ({"accelerator_type": "tpu7x-16"}, "GKE only"),
    ({"accelerator_type": "v3-32", "num_slices": 2}, "do not form a multislice"),
    ({"tier": "cheap"}, "unknown tier 'cheap'"),
    ({"num_slices": 0}, "--num-slices 0"),
])
def test_orders_the_api_would_refuse_are_refused_here(kw, says):
    """A flag's fault, found before the API is asked: exit 2 (bad input), not 3 (the API refused)."""
    with pytest.raises(LaunchError, match=says) as e:
        order(**kw)
    assert e.value.exit_code == ExitCode.USAGE


@pytest.mark.parametrize("node, qr, recreate", [
    ("READY", "ACTIVE", False),  # a node lost for another reason: the slice is fine
    ("PREEMPTED", "ACTIVE", True),
    ("TERMINATED", None, True),
    (None, "SUSPENDED", True),  # the QR's nodes are deleted once it is SUSPENDED
    ("READY", "SUSPENDING", True),
    ("READY", "FAILED", True),
    (None, None, True),
])
def test_when_a_slice_must_be_made_again(node, qr, recreate):
    assert (must_recreate(node, qr) is not None) is recreate


def _cluster(**remote) -> ClusterInfo:
    head = dict(head_ip="10.0.0.9", dashboard_port=8265) if remote.get("head") == "local" else {}
    return ClusterInfo(address="10.0.0.1:6379", temp_dir="/tmp/tpl-x", token_path=None, emulated=False,
                       remote=RemoteSpec(("s",), "z", "p", 6379, "/tmp/ray", "python3", **remote, **head))


def test_recreate_is_refused_without_a_head_off_the_slice_or_on_emulation():
    def refusal(cluster):
        return providers.of(cluster).recreate_refusal()

    assert "the head would be preempted with the slice" in refusal(_cluster(head="worker-0"))
    assert "emulated" in refusal(None)
    assert "--head local" in refusal(ClusterInfo(address="a:1", temp_dir=None, token_path=None, emulated=False))
    assert refusal(_cluster(head="local")) is None


def test_a_plan_follows_a_recreated_slice_to_its_new_addresses():
    topo = resolve("v4-16")

    def spec(ips):
        return SliceSpec(name="s", accelerator_type="v4-16", topology=topo.topology, source="tpu-api",
                         workers=tuple(WorkerEndpoint(i, ip) for i, ip in enumerate(ips)))

    plan = build_plan(slices=[spec(["10.0.0.2", "10.0.0.3"])], mesh=plan_mesh(topo), script="t.py", run_id="r",
                      coordinator_port=8476, emulated=False, log_dir="/l", workdir="/w")
    moved = plan.for_attempt(1).on_slices([spec(["10.0.9.7", "10.0.9.8"])])
    assert moved.endpoints.host == "10.0.9.7" and moved.endpoints.master_port == 8476 and moved.attempt == 1
    assert [h.ip for h in moved.hosts] == ["10.0.9.7", "10.0.9.8"]
    assert moved.env(1)["TPU_WORKER_HOSTNAMES"] == "10.0.9.7,10.0.9.8"
    with pytest.raises(LaunchError):
        plan.on_slices([SliceSpec(name="other", accelerator_type="v4-16", topology=topo.topology, source="x",
                                  workers=spec(["1.1.1.1", "1.1.1.2"]).workers)])


def test_a_multislice_run_keeps_its_slice_order_when_one_slice_is_made_again():
    def spec(name, index, ip):
        return SliceSpec(name=name, accelerator_type="v4-8", topology="2x2x1", source="ray", slice_index=index,
                         workers=(WorkerEndpoint(0, ip),))

    run = (spec("b", 0, "10.0.0.2"), spec("a", 1, "10.0.0.3"))  # the run's own order, not the cluster's
    now = [spec("a", 0, "10.0.0.3"), spec("b", 1, "10.9.0.2")]  # the cluster's record after b came back
    moved = in_run_order(run, now)
    assert [(s.name, s.slice_index, s.workers[0].ip) for s in moved] == [("b", 0, "10.9.0.2"), ("a", 1, "10.0.0.3")]
    assert qr_id(SliceSpec(name="b", accelerator_type="v4-8", topology="2x2x1", source="tpu-api",
                           queued_resource="projects/p/locations/z/queuedResources/qr-b")) == "qr-b"
    assert qr_id(spec("a", 0, "10.0.0.3")) == ""


class _Scripted(Comeback):
    """A Comeback whose calls to the Cloud TPU API and the VMs answer from a script: each step
    either succeeds or fails its set-up or join with the reason given; `preempted` is what the API
    says after each failure."""

    def __init__(self, steps: list[str | None], preempted: list[bool], budget: int) -> None:
        self.said: list[str] = []
        super().__init__(_cluster(head="local"), ["s"], self.said.append, budget=budget, pause=lambda s: None)
        self.steps, self.answers, self.calls = steps, preempted, []

    def _step(self, kind: str) -> None:
        self.calls.append(kind)
        why = self.steps.pop(0)
        if why is not None:
            raise RejoinFailed(why)

    def bring_back(self, deadline_s):
        rec = Recreation("s", "s", "its node is PREEMPTED")
        try:
            self._step("make")
        except RejoinFailed as e:
            rec.join_failures.append(e.why)
            e.made = [rec]
            raise
        return [rec], []

    def rejoin(self, deadline_s):
        self._step("join")
        return []

    def preempted_again(self):
        return self.answers.pop(0)


def test_new_vms_that_cannot_join_are_joined_again_and_a_slice_preempted_again_is_made_again():
    # made; its VMs slow to start Ray (join again); then preempted before they joined (made again)
    back = _Scripted(["ray start timed out", "cannot be reached", None], preempted=[False, True], budget=2)
    back.run(60)
    assert back.calls == ["make", "join", "make"] and back.again == 1
    assert [r.join_failures for r in back.made] == [["ray start timed out", "cannot be reached"], []]
    assert all(r.to_dict()["join_failures"] == r.join_failures for r in back.made)
    assert [s.split(" (")[0] for s in back.said] == ["slice(s) s not back yet", "slice(s) s lost again while being brought back"]


def test_a_slice_preempted_again_with_no_preemption_left_ends_it_and_keeps_the_record():
    back = _Scripted(["cannot be reached"], preempted=[True], budget=0)
    with pytest.raises(RejoinFailed):
        back.run(60)
    assert back.calls == ["make"] and back.again == 0
    assert [r.join_failures for r in back.made] == [["cannot be reached"]]  # the caller still sees it made


def test_a_join_again_keeps_the_new_vms_that_joined_and_starts_only_the_others(tmp_path, monkeypatch):
    """Re-created VMs joining after a join that half failed (worker 1 joined, worker 0 did not):
    worker 1's node is the new VM's own, so only worker 0 is started. Taken for an old VM's node
    (`replaced`, the first join's rule), it would be waited on until the preemption wait ran out."""
    from tpulaunch.cluster.remote import RemoteSlice, ensure_token
    from tpulaunch.errors import ClusterError

    monkeypatch.setenv("TPULAUNCH_HOME", str(tmp_path))

    class HalfJoined(RemoteSlice):
        started: list[int] = []

        def query(self) -> dict:
            return {"head": True, "nodes": [
                {"Alive": True, "Labels": {"ray.io/tpu-slice-name": "s", "ray.io/tpu-worker-id": "1"}},
                {"Alive": False, "Labels": {"ray.io/tpu-slice-name": "s", "ray.io/tpu-worker-id": "0"}}]}

        def _start(self, worker: int, token: str, head: bool) -> None:
            self.started.append(worker)

    topo = resolve("v4-16")
    rs = HalfJoined(SliceSpec(name="s", accelerator_type="v4-16", topology=topo.topology, source="tpu-api",
                              zone="z", project="p",
                              workers=(WorkerEndpoint(0, "10.0.9.7"), WorkerEndpoint(1, "10.0.9.8"))))
    ensure_token(rs.key)  # the cluster's, as the head has it
    said: list[tuple[int, str]] = []
    rs.up(progress=lambda w, s: said.append((w, s)), replaced=False)
    assert rs.started == [0] and (1, "already in the cluster") in said
    with pytest.raises(ClusterError, match="Ray still counts the old VMs of 's' as alive"):
        rs.up(replaced=True, replaced_wait_s=0)


def test_comeback_joins_again_as_a_join_again(monkeypatch):
    """`Comeback` retries a join of VMs it made with `again=True` (the rule above), its first join not."""
    from tpulaunch.providers.tpu_vm import TpuVmProvider

    calls: list[bool] = []
    monkeypatch.setattr(TpuVmProvider, "_rejoin", lambda *a, again=False, **k: calls.append(again) or [])
    Comeback(_cluster(head="local"), ["s"], lambda m: None, budget=1).rejoin(10)
    assert calls == [True]


def test_a_vm_gcloud_calls_preempted_or_gone_is_gone_for_ssh():
    """gcloud's own words (tpu_vm/exceptions.py, and NOT_FOUND from the API): `cluster down` reports
    such a worker as gone, not as a failed stop."""
    from tpulaunch.gcloud import SshResult

    say = "ERROR: (gcloud.compute.tpus.tpu-vm.ssh) "
    preempted = say + 'This TPU has terminal state "PREEMPTED", so it cannot be used anymore.'
    missing = say + "NOT_FOUND: projects/p/locations/z/nodes/n"
    stopped = say + 'This TPU has state "STOPPED", so it cannot be currently connected to.'
    assert SshResult(1, "", preempted).vm_gone and SshResult(1, "", missing).vm_gone
    assert not SshResult(1, "", stopped).vm_gone and not SshResult(255, "", "ssh: connect to host: timed out").vm_gone



def test_a_summary_carries_each_recreated_slice_typed_until_it_is_written():
    """Attempt.recreated holds Recreation values; the summary's JSON has them as the documented
    dicts, their step times rounded to 0.01 s."""
    from tpulaunch.run.summary import Attempt, Outcome, RunSummary

    rec = Recreation("ms-b", "ms-b", "its queued resource is SUSPENDED", {"delete_s": 1.23456, "create_s": 0.5})
    rec.steps["ray_whole_s"] = 2.0049  # set after the slice is back in Ray, on the same value
    a = Attempt(index=0, outcome=Outcome.PREEMPTED, exit_code=75, hosts=[], log_dir="/l", recreated=[rec])
    s = RunSummary(run_id="r", exit_code=0, emulated=False, slices=[], mesh={}, hosts=[], first_failure=None,
                   log_dir="/l", wall_s=1.0, attempts=[a])
    want = {"slice": "ms-b", "queued_resource": "ms-b", "why": "its queued resource is SUSPENDED",
            "steps": {"delete_s": 1.23, "create_s": 0.5, "ray_whole_s": 2.0}, "join_failures": []}
    assert a.to_dict()["recreated"] == [want]
    assert s.to_dict()["attempts"][0]["recreated"] == [want]
    assert json.loads(json.dumps(s.to_dict()))["attempts"][0]["outcome"] == "preempted"
