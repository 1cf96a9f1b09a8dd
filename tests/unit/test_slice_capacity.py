"""`tpulaunch slice create|delete|list` and the re-create loop's API side, in process, against the
fake Cloud TPU API (queued resources, long-running operations, states moving with the clock)."""

from __future__ import annotations

import json
import urllib.request

import pytest

from fakes import cli_env, flat, invoke
from fakes.tpu_api_server import FakeTpuApi

from tpulaunch.provision import capacity
from tpulaunch.errors import CapacityError, ExitCode

ZONE = "us-central2-b"
C2 = ["--zone", ZONE, "--project", "p"]
PARENT = f"projects/p/locations/{ZONE}"


@pytest.fixture
def api(request, tmp_path):
    # "slow" (parametrize indirectly): PROVISIONING lasts 4 s, so the CLI's polls (0.5 s apart, then
    # 1.5 times longer each: 4 of them by 4.3 s) see every state even when this machine is busy (a 0.3 s
    # window fell between two polls; so did a 1 s one, beside the rest of the suite at nice 10).
    # Otherwise a slice is ACTIVE at the CLI's second poll.
    wait_s, provision_s = (0.3, 4.0) if getattr(request, "param", "quick") == "slow" else (0.05, 0.05)
    with FakeTpuApi(wait_s=wait_s, provision_s=provision_s, suspend_s=0.3,
                    gcloud_slices=str(tmp_path / "slices.json")) as fake:
        yield fake


@pytest.fixture
def env(api, tmp_path):
    return cli_env(tmp_path / "home", TPULAUNCH_TPU_API_ENDPOINT=api.url)


@pytest.fixture
def api_env(api, monkeypatch):
    monkeypatch.setenv("TPULAUNCH_TPU_API_ENDPOINT", api.url)
    return api


def created_body(api) -> dict:
    (call,) = api.calls("create_qr")
    assert call["query"]["queuedResourceId"] and call["query"]["requestId"][0]
    return call["body"]


# -- request bodies as the REST reference has them ---------------------------------------------------


@pytest.mark.parametrize("api", ["slow"], indirect=True)
def test_create_spot_by_type_waits_through_the_states(api, env):
    proc = invoke("slice", "create", "s1", "--accelerator", "v4-16", "--spot", "--wait", *C2, env=env)
    assert proc.returncode == 0, proc.stderr
    body = created_body(api)
    assert body == {"tpu": {"nodeSpec": [{"parent": PARENT, "nodeId": "s1", "node": {
        "acceleratorType": "v4-16", "runtimeVersion": "tpu-ubuntu2204-base", "schedulingConfig": {"spot": True},
        "networkConfig": {"enableExternalIps": True}}}]}, "spot": {}}
    err = flat(proc.stderr)
    # the first state is said when the request is accepted, or on the first poll, whichever sees it (a
    # busy machine may poll only after the fake moved on); then every change, in order
    waiting = min(err.index(w) for w in ("accepted (WAITING_FOR_RESOURCES)", "s1: WAITING_FOR_RESOURCES") if w in err)
    assert waiting < err.index("s1: PROVISIONING") < err.index("s1: ACTIVE"), err
    assert proc.stdout.strip() == "s1: ACTIVE"
    node = api.nodes[f"{PARENT}/nodes/s1"]  # the slice exists, as the service made it
    assert node["queuedResource"] == f"{PARENT}/queuedResources/s1" and node["schedulingConfig"] == {"spot": True}
    assert len(node["networkEndpoints"]) == 2
    slices = json.loads(api.gcloud_slices and open(api.gcloud_slices).read())
    assert slices[f"p/{ZONE}/s1"]["topology"] == "2x2x2" and len(slices[f"p/{ZONE}/s1"]["worker_ips"]) == 2
    assert api.rejected == []


def test_create_reserved_by_topology_sends_accelerator_config_with_an_int_enum(api, env):
    proc = invoke("slice", "create", "s2", "--accelerator", "v5p", "--topology", "2x2x2", "--reserved", "--json",
                  *C2, env=env)
    assert proc.returncode == 0, proc.stderr
    body = created_body(api)
    node = body["tpu"]["nodeSpec"][0]["node"]
    assert node["acceleratorConfig"] == {"type": 10, "topology": "2x2x2"}  # V5P, as the client encodes enums
    assert "acceleratorType" not in node and node["runtimeVersion"] == "v2-alpha-tpuv5"
    assert body["reservationName"] == f"{PARENT}/reservations/-" and "spot" not in body
    doc = json.loads(proc.stdout)
    assert doc["state"] == "WAITING_FOR_RESOURCES" and doc["nodes"] == ["s2"] and doc["request"]["reservationName"]


def test_create_multislice_guaranteed(api, env):
    proc = invoke("slice", "create", "ms", "--accelerator", "v4-16", "--num-slices", "2", "--guaranteed", "--wait",
                  "--subnetwork", "tpu-sub", "--internal-ips", "--json", *C2, env=env)
    assert proc.returncode == 0, proc.stderr
    body = created_body(api)
    spec = body["tpu"]["nodeSpec"][0]
    assert spec["multisliceParams"] == {"nodeCount": 2, "nodeIdPrefix": "ms"} and "nodeId" not in spec
    assert spec["node"]["networkConfig"] == {"subnetwork": "tpu-sub"}  # enableExternalIps false: proto3 sends no default
    assert body["guaranteed"] == {}
    assert json.loads(proc.stdout)["nodes"] == ["ms-0", "ms-1"]
    assert sorted(n.rsplit("/", 1)[1] for n in api.nodes) == ["ms-0", "ms-1"]
    assert all(n["multisliceNode"] for n in api.nodes.values())


# -- errors: one line, exit 3, nothing half-made -----------------------------------------------------


def test_quota_is_one_line_exit_3(api, env):
    api.set_capacity(quota="TPUV4sPreemptiblePodPerProjectPerRegionForTPUAPI")
    proc = invoke("slice", "create", "s3", "--accelerator", "v4-16", "--spot", *C2, env=env)
    assert proc.returncode == ExitCode.DISCOVERY == 3
    err = proc.stderr.strip()
    assert len(err.splitlines()) <= 2 and "Traceback" not in err  # the error and its hint
    assert "Quota limit 'TPUV4sPreemptiblePodPerProjectPerRegionForTPUAPI' has been exceeded" in flat(err)
    assert api.queued_resources == {}


def test_a_stockout_keeps_the_request_waiting_until_the_wait_timeout(api, env):
    """A zone without capacity keeps the request WAITING_FOR_RESOURCES (the service fails none for
    that): `--wait` ends at its own bound, exit 3, saying so and which option waits longer."""
    api.set_capacity(stockout=True)
    proc = invoke("slice", "create", "s4", "--accelerator", "v4-16", "--wait", "--wait-timeout", "2", *C2, env=env)
    assert proc.returncode == 3
    err = flat(proc.stderr)
    assert "queued resource 's4' is still WAITING_FOR_RESOURCES after 2 s" in err
    assert "the zone has no capacity for it now: wait longer (--wait-timeout), or try another zone or tier" in err
    assert "Traceback" not in err


def test_wait_is_bounded(tmp_path):
    with FakeTpuApi(wait_s=60) as fake:
        env = cli_env(tmp_path / "home", TPULAUNCH_TPU_API_ENDPOINT=fake.url)
        proc = invoke("slice", "create", "s5", "--accelerator", "v4-16", "--wait", "--wait-timeout", "1", *C2, env=env)
    assert proc.returncode == 3
    assert "queued resource 's5' is still WAITING_FOR_RESOURCES after 1 s" in flat(proc.stderr)


@pytest.mark.parametrize("args, says", [
    (["--runtime-version", "tpu-ubuntu1804"], "Invalid runtime version 'tpu-ubuntu1804'"),
    (["--accelerator", "v4-17"], "v4-17"),
    (["--spot", "--reserved"], "--spot and --reserved: a slice has one tier"),
    (["--accelerator", "v4", "--topology", "2x2x2", "--flex-start", "--max-run-duration", "24h"],
     "--flex-start cannot be requested through the Cloud TPU API v2"),
    (["--accelerator", "tpu7x-16"], "cannot be created through the Cloud TPU API v2"),
])
def test_bad_requests_are_one_line(api, env, args, says):
    base = ["--accelerator", "v4-16"] if "--accelerator" not in args else []
    proc = invoke("slice", "create", "s6", *base, *args, *C2, env=env)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    assert says in flat(proc.stderr), proc.stderr
    assert api.queued_resources == {}


def test_existing_name_is_refused(api, env):
    assert invoke("slice", "create", "s7", "--accelerator", "v4-16", *C2, env=env).returncode == 0
    proc = invoke("slice", "create", "s7", "--accelerator", "v4-16", *C2, env=env)
    assert proc.returncode == 3 and "queued resource s7 already exists" in flat(proc.stderr)


def test_list_and_delete(api, env):
    assert invoke("slice", "create", "s8", "--accelerator", "v4-16", "--spot", "--wait", *C2, env=env).returncode == 0
    doc = json.loads(invoke("slice", "list", "--json", *C2, env=env).stdout)
    assert [(q["name"], q["state"]) for q in doc["queued_resources"]] == [("s8", "ACTIVE")]
    assert [n["name"] for n in doc["nodes"]] == ["s8"]
    proc = invoke("slice", "delete", "s8", *C2, env=env)
    assert proc.returncode == 0, proc.stderr
    (call,) = api.calls("delete_qr")
    assert call["query"]["force"] == ["true"]
    after = json.loads(invoke("slice", "list", "--json", *C2, env=env).stdout)
    assert after["queued_resources"] == [] and after["nodes"] == []
    assert json.loads(open(api.gcloud_slices).read()) == {}  # the VMs are gone for gcloud too
    again = invoke("slice", "delete", "s8", *C2, env=env)
    assert again.returncode == 3 and "queued resource 's8' not found" in flat(again.stderr)


# -- what preemption does, and the API side of re-creating -------------------------------------------


def test_preempt_through_the_control_endpoint_suspends_the_queued_resource(api_env, env):
    api = api_env
    assert invoke("slice", "create", "s9", "--accelerator", "v4-16", "--spot", "--wait", *C2, env=env).returncode == 0
    req = urllib.request.Request(api.url + "/_fake/preempt", data=json.dumps({"node": "s9"}).encode(), method="POST")
    urllib.request.urlopen(req, timeout=10).read()
    assert api.nodes[f"{PARENT}/nodes/s9"]["state"] == "PREEMPTED"
    st = capacity.get("p", ZONE, "s9")
    assert st is None or st.state in ("SUSPENDING", "SUSPENDED")
    import time

    time.sleep(0.4)
    doc = json.loads(invoke("slice", "list", "--json", *C2, env=env).stdout)
    assert [(q["name"], q["state"], q["initiator"]) for q in doc["queued_resources"]] == [("s9", "SUSPENDED", "SERVICE")]
    assert doc["nodes"] == [] and api.rejected == []


def test_recreate_deletes_and_creates_from_the_stored_spec(api_env):
    order = capacity.check_order(capacity.SliceOrder("r1", "p", ZONE, "v4-16", tier="spot"))
    capacity.create(order)
    capacity.wait_active("p", ZONE, "r1", 10)
    api_env.preempt("r1")
    seen: list[str] = []
    st, took = capacity.recreate("p", ZONE, "r1", 20, seen.append, retry_s=0.2)
    assert st.state == "ACTIVE" and set(took) == {"delete_s", "create_s", "provision_s"}
    assert api_env.events == ["create r1", "preempt r1", "delete r1", "create r1"]
    first, second = [c["body"] for c in api_env.calls("create_qr")]
    assert first == second  # the same spec, read back from the API
    assert any("SUSPEND" in m for m in seen) and seen[-1].endswith("ACTIVE")


def test_recreate_waits_for_a_forced_delete_within_its_own_deadline(api_env, monkeypatch):
    """A preempted slice's queued resource still SUSPENDING has its nodes: the service deletes them
    before the queued resource, which takes longer than one API call's budget (minutes, where it is
    seconds here: 1.5 s against 0.5). The re-creation waits for it within its own deadline."""
    monkeypatch.setenv("TPULAUNCH_API_TIMEOUT", "0.5")
    capacity.create(capacity.check_order(capacity.SliceOrder("r3", "p", ZONE, "v4-16", tier="spot")))
    capacity.wait_active("p", ZONE, "r3", 10)
    api_env.suspend_s, api_env.delete_s = 30.0, 1.5  # still SUSPENDING, with its nodes, when deleted
    api_env.preempt("r3")
    st, took = capacity.recreate("p", ZONE, "r3", 20, retry_s=0.2)
    assert st.state == "ACTIVE" and took["delete_s"] >= 1.5
    assert api_env.events == ["create r3", "preempt r3", "delete r3", "create r3"]


def test_recreate_in_a_stockout_waits_to_its_deadline_and_says_so(api_env):
    capacity.create(capacity.check_order(capacity.SliceOrder("r2", "p", ZONE, "v4-16", tier="spot")))
    capacity.wait_active("p", ZONE, "r2", 10)
    api_env.preempt("r2")
    api_env.set_capacity(stockout=True)
    with pytest.raises(CapacityError) as e:
        capacity.recreate("p", ZONE, "r2", 3, retry_s=0.2)
    assert "queued resource 'r2' is still WAITING_FOR_RESOURCES after 3 s" in e.value.line()
    assert "wait longer (--preemption-wait)" in e.value.line()
    assert len(api_env.calls("create_qr")) == 2  # made, then asked for again once: a waiting request is kept


def test_recreate_asks_again_for_a_request_the_service_failed(api_env):
    """A request whose validity window (`queueingPolicy`, as `gcloud ... --valid-until-duration` sets
    it) closed before the zone had capacity is FAILED: deleted and asked for again from the spec the
    API holds, until the deadline, which gives the service's reason."""
    order = capacity.check_order(capacity.SliceOrder("r4", "p", ZONE, "v4-16", tier="spot"))
    capacity.create(order, body={**capacity.queued_resource_body(order), "queueingPolicy": {"validUntilDuration": "0.4s"}})
    capacity.wait_active("p", ZONE, "r4", 10)
    api_env.preempt("r4")
    api_env.set_capacity(stockout=True)
    seen: list[str] = []
    with pytest.raises(CapacityError) as e:
        capacity.recreate("p", ZONE, "r4", 3, seen.append, retry_s=0.2)
    assert "queued resource 'r4' is FAILED: The queued resource request could not be fulfilled" in e.value.line()
    creates = api_env.calls("create_qr")
    assert len(creates) >= 3 and any("deleting and asking again" in m for m in seen)
    assert all(c["body"] == creates[1]["body"] and c["body"]["queueingPolicy"] for c in creates[1:])
